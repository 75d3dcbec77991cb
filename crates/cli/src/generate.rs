//! `kiln generate`: man pages and shell completions, made from the command line's own clap
//! definitions so they never drift from `--help`. The package build (scripts/package.sh) runs
//! it; so can anyone who installs by hand.

use std::path::{Path, PathBuf};

use clap::{CommandFactory, Subcommand};
use kiln_proto::Error;

/// What `kiln generate` writes.
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    #[command(subcommand)]
    what: What,
    /// Print the result as one JSON object: the files written, or the completion script as
    /// {"ok": true, "shell", "script"}.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Subcommand, Debug)]
enum What {
    /// Write the man pages into DIR: kiln.1 and one page per subcommand (kiln-volume.1,
    /// kiln-volume-create.1, ...), and kilnd.8 for the server.
    Man {
        /// The directory to write into (created if missing).
        dir: PathBuf,
    },
    /// Print the completion script for SHELL on stdout (bash: save it as
    /// /usr/share/bash-completion/completions/kiln).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// `kiln generate`; `kiln` is the whole command line's definition.
pub fn main(args: GenerateArgs, kiln: clap::Command) -> Result<(), Error> {
    match args.what {
        What::Man { dir } => {
            let pages = man(kiln, &dir)?;
            let r = serde_json::json!({ "dir": dir.display().to_string(), "pages": pages });
            crate::out::show(args.json, &r, |_| String::new());
            if !args.json {
                eprintln!("kiln: {} man pages in {}", pages.len(), dir.display());
            }
        }
        What::Completions { shell } => {
            let mut kiln = kiln;
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut kiln, "kiln", &mut script);
            let script = String::from_utf8(script).map_err(|e| Error::failed(e.to_string()))?;
            let r = serde_json::json!({ "shell": shell.to_string(), "script": script });
            crate::out::show(args.json, &r, |_| script.clone());
        }
    }
    Ok(())
}

/// Writes the pages into `dir`; returns their file names, sorted.
fn man(kiln: clap::Command, dir: &Path) -> Result<Vec<String>, Error> {
    let fail = |e: std::io::Error| format!("cannot write man pages into {}: {e}", dir.display());
    std::fs::create_dir_all(dir)
        .map_err(fail)
        .map_err(Error::failed)?;
    clap_mangen::generate_to(kiln, dir)
        .map_err(fail)
        .map_err(Error::failed)?;
    // The daemon's page is in section 8, where system services are looked for.
    let kilnd = kilnd::ServeArgs::command().name("kilnd").bin_name("kilnd");
    clap_mangen::Man::new(kilnd)
        .section("8")
        .generate_to(dir)
        .map_err(fail)
        .map_err(Error::failed)?;
    let mut pages: Vec<String> = std::fs::read_dir(dir)
        .map_err(fail)
        .map_err(Error::failed)?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    pages.sort();
    Ok(pages)
}
