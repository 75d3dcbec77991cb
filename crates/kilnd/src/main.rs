//! kilnd: serve one brick directory.

use clap::Parser;

fn main() -> std::process::ExitCode {
    kilnd::main(kilnd::ServeArgs::parse())
}
