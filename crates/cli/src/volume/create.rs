//! `kiln volume create`: the arguments (`[replica N] HOST:/DIR... [force]`), the question
//! asked before a replica 2 volume, and the request.

use kiln_mgmt::response::Changed;
use kiln_mgmt::Request;

use super::{mgmt_call, show, warn, MgmtOpts};
use kiln_proto::Error;

#[derive(clap::Args, Debug)]
pub(super) struct CreateArgs {
    /// The volume's name: letters, digits, '_' and '-'.
    name: String,
    /// `replica N` (optional), then the bricks: HOST:/DIR or HOST:MGMTPORT:/DIR, then
    /// `force` (optional) to accept bricks in system or home directories (`/`, `/etc`, `/usr`,
    /// `/var/lib`, `/root`, `/home/USER`, ...). A brick inside kilnd's state directory or
    /// around it, or inside or around another volume's brick, is refused even with `force`
    /// (its clients could read the pool's secrets or the other volume's files). Symlinks are
    /// resolved first.
    #[arg(required = true, value_name = "[replica N] HOST:/DIR... [force]")]
    args: Vec<String>,
    /// Do not ask: create a replica 2 volume (prone to split-brain) without confirming.
    #[arg(long, short = 'y')]
    yes: bool,
    /// Clients of the bricks may connect only from this address range (ADDR/PREFIX; repeat
    /// for several; default: from anywhere). Change it later with `kiln volume set`.
    #[arg(long, value_name = "CIDR")]
    allow: Vec<String>,
    /// Store files in pieces of SIZE (a power of two from 1M to 1T; default 4M when given
    /// without a size) striped over the replica sets, so that one big image reads and writes
    /// with all of them, a rebalance moves pieces and heal copies only the pieces a replica
    /// missed. Chosen here for good: files keep the pieces they were written in.
    #[arg(long, value_name = "SIZE", num_args = 0..=1, default_missing_value = "4M")]
    shard: Option<String>,
    #[command(flatten)]
    opts: MgmtOpts,
}

/// `[replica N] BRICK...` split into the count (if given) and the bricks.
pub(super) fn replica_and_bricks(
    cmd: &str,
    name: &str,
    args: &[String],
) -> Result<(Option<u64>, Vec<String>), Error> {
    let mut args = args;
    let mut replica = None;
    if args.first().map(String::as_str) == Some("replica") {
        let n = args
            .get(1)
            .ok_or_else(|| Error::invalid(format!("volume {cmd}: `replica` needs a count")))?;
        replica = Some(
            n.parse()
                .ok()
                .filter(|n| *n >= 1)
                .ok_or_else(|| Error::invalid(format!("volume {cmd}: bad replica count {n:?}")))?,
        );
        args = &args[2..];
    }
    if args.is_empty() {
        return Err(Error::invalid(format!(
            "volume {cmd}: {name}: no bricks given (HOST:/DIR ...)"
        )));
    }
    Ok((replica, args.to_vec()))
}

pub(super) fn create(a: &CreateArgs) -> Result<(), Error> {
    let mut args = a.args.clone();
    let force = args.last().map(String::as_str) == Some("force");
    if force {
        args.pop();
    }
    let (replica, bricks) = replica_and_bricks("create", &a.name, &args)?;
    if replica == Some(2) && !a.yes {
        confirm_replica_2(&a.name)?;
    }
    let shard = a
        .shard
        .as_deref()
        .map(kiln_mgmt::options::parse_size)
        .transpose()
        .map_err(|e| e.context(format_args!("volume create: {}: --shard", a.name)))?;
    let req = Request::Create {
        name: a.name.clone(),
        replica: Some(replica.unwrap_or(1)),
        bricks,
        allow: a.allow.clone(),
        shard,
        force,
    };
    let r: Changed = mgmt_call(&a.opts, &req)?;
    show(&a.opts, &r, |_| {
        format!(
            "volume create: {}: success: please start the volume to access data\n",
            a.name
        )
    });
    warn(&r.warnings);
    Ok(())
}

/// Asks before a replica 2 volume is made, as GlusterFS does: two copies cannot out-vote each
/// other.
fn confirm_replica_2(name: &str) -> Result<(), Error> {
    let why = "replica 2 volumes are prone to split-brain (two copies that changed apart, and \
               no majority to say which is right); replica 3 avoids it";
    confirm(
        &format!("volume create: {name}"),
        why,
        &format!("Create volume {name} with replica 2 anyway?"),
    )
    .map_err(|e| {
        Error::new(
            e.kind(),
            e.message().replace("go ahead", "create it anyway"),
        )
    })
}

/// Asks `question` at the terminal after saying `why`; `what` names the command in errors.
/// Without a terminal to ask at (a script, a pipe) it refuses: the caller passes `--yes`.
pub(super) fn confirm(what: &str, why: &str, question: &str) -> Result<(), Error> {
    use std::io::{BufRead, IsTerminal, Write};
    if !std::io::stdin().is_terminal() {
        return Err(Error::invalid(format!(
            "{what}: {why}. Pass --yes to go ahead"
        )));
    }
    eprint!("kiln: {why}.\n{question} (y/N) ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    let _ = std::io::stdin().lock().read_line(&mut answer);
    match answer.trim() {
        "y" | "Y" | "yes" => Ok(()),
        _ => Err(Error::failed(format!("{what}: not done"))),
    }
}
