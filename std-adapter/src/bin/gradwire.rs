//! `gradwire`: compress, decompress and inspect gradients stored as safetensors files (the
//! tool is [`gradwire::cli`]; `gradwire --help` lists its commands).
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    gradwire::cli::main()
}
