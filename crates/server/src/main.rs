//! kilnd: serve one brick directory.

use clap::Parser;

fn main() -> std::process::ExitCode {
    kiln_server::cli::main(kiln_server::cli::ServeArgs::parse())
}
