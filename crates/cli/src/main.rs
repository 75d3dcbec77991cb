//! `kiln`: the one Kiln command line.

mod bench;
mod demo;

use clap::{Parser, Subcommand};

/// Kiln: a distributed network file system with an accounted, zero-copy data path.
#[derive(Parser, Debug)]
#[command(name = "kiln", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Start a local brick on a temporary directory and use it for real: write, read back and
    /// verify data, exercise metadata, and measure.
    Demo(demo::DemoArgs),
    /// Load generator on the native API (fio-like): throughput, latency percentiles, CPU.
    Bench(bench::BenchArgs),
    /// Run a brick server in the foreground (the same as `kilnd`).
    Server(kiln_server::cli::ServeArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Server(a) => return kiln_server::cli::main(a),
        Cmd::Demo(a) => {
            kiln_server::cli::init_logging();
            demo::main(a)
        }
        Cmd::Bench(a) => {
            kiln_server::cli::init_logging();
            bench::main(a)
        }
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiln: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
