//! Writes the seed inputs of every target into `fuzz/corpus/<target>/seed-<crc>`.
//!
//! `cargo run --manifest-path fuzz/Cargo.toml -p gradwire-fuzz-logic --example make_seeds --
//! fuzz/corpus testdata/golden /work/shared/data`: golden frames (`*.bin` / `*.gwf` files
//! under the second directory) join the frame targets; small `ref_*_step1.safetensors` payloads
//! under the third seed the reference-layout target.
use std::path::Path;

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let corpus = Path::new(args.first().map_or("fuzz/corpus", |s| s.as_str()));
    let mut golden = Vec::new();
    if let Some(dir) = args.get(1) {
        collect(Path::new(dir), &mut golden)?;
    }
    let golden: Vec<Vec<u8>> = golden
        .into_iter()
        .filter(|b| b.starts_with(b"GWRF"))
        .collect();
    eprintln!("{} golden frames", golden.len());
    let mut seeds = gradwire_fuzz_logic::seeds::core_seeds(&golden);
    if let Some(dir) = args.get(2) {
        seeds.extend(gradwire_fuzz_logic::seeds::std_seeds(Path::new(dir)));
    }
    for (target, bytes) in &seeds {
        let dir = corpus.join(target);
        std::fs::create_dir_all(&dir)?;
        // FNV-1a, not CRC-32: the CRC of a frame with its own CRC trailer is a constant.
        let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        let name = format!("seed-{h:016x}");
        std::fs::write(dir.join(name), bytes)?;
    }
    eprintln!("{} seeds", seeds.len());
    Ok(())
}

fn collect(dir: &Path, out: &mut Vec<Vec<u8>>) -> std::io::Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            collect(&p, out)?;
        } else {
            out.push(std::fs::read(&p)?);
        }
    }
    Ok(())
}
