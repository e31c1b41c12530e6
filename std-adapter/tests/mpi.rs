//! Runs the `mpi_selftest` example under `mpirun -np 4` and checks that every rank reports ok.
//!
//! This test builds nothing: it expects the example next to the test binary, in
//! `target/<profile>/examples/mpi_selftest`. `cargo test --features mpi` builds examples; with a
//! target filter such as `--test mpi`, build it first:
//! `cargo build -p gradwire --features mpi --example mpi_selftest`.
#![cfg(feature = "mpi")]

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

const RANKS: usize = 4;
const TIME_LIMIT: Duration = Duration::from_secs(300);

/// `target/<profile>/examples/mpi_selftest`, from `target/<profile>/deps/mpi-<hash>`.
fn selftest_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("path of the test binary");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test binary lives in target/<profile>/deps");
    let bin = profile_dir
        .join("examples")
        .join(format!("mpi_selftest{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "{} is missing: build it with `cargo build -p gradwire --features mpi --example \
         mpi_selftest` (plain `cargo test --features mpi` builds it too)",
        bin.display()
    );
    bin
}

#[test]
fn four_ranks_report_ok() {
    let bin = selftest_binary();
    let mut child = Command::new("mpirun")
        .args(["-np", &RANKS.to_string(), "--oversubscribe"])
        .arg(&bin)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun not found: install Open MPI (.ci/install-mpi.sh)");

    // Drain both pipes in threads so a chatty child never blocks on a full pipe.
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let out_reader = thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let err_reader = thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });

    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for mpirun") {
            break Some(status);
        }
        if start.elapsed() > TIME_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(50));
    };
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    let report = format!("--- stdout\n{stdout}--- stderr\n{stderr}");

    let status = status.unwrap_or_else(|| panic!("mpirun ran past {TIME_LIMIT:?}\n{report}"));
    assert!(status.success(), "mpirun failed: {status}\n{report}");
    for rank in 0..RANKS {
        let line = format!("mpi_selftest rank {rank}/{RANKS} ok");
        assert!(
            stdout.lines().any(|l| l.trim() == line),
            "missing `{line}`\n{report}"
        );
    }
}
