//! The heal service: the pool's leader heals every replicated volume by
//! itself, while I/O continues — no one has to run `kiln volume heal`.
//!
//! Every `--heal-interval` seconds it looks at each started replicated volume of the
//! pool (over connections of its own, kept between rounds; they reconnect to a
//! returning brick by themselves) and, when a replica that is up is behind, runs the same heal
//! as `kiln volume heal`: exactly the marked ranges, under heal locks. What it did is in
//! `kiln volume status` (backlog, files and bytes healed, the last error).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kiln_layer::heal;

use crate::def::{VolState, VolumeDef};
use crate::manager::Manager;
use kiln_proto::error::Context as _;
use kiln_proto::Error;

/// A volume's client stack as the service uses it, rebuilt when the definition changes.
struct Client {
    id: String,
    /// Each brick's place and port: a brick replaced or moved makes a new client.
    ports: Vec<(String, Option<u16>)>,
    vol: kiln_client::Volume,
}

/// Starts the service thread: a round every `every`.
pub fn start(manager: Arc<Manager>, every: Duration) {
    let run = move || {
        let mut clients: HashMap<String, Client> = HashMap::new();
        loop {
            // A timer, not synchronisation: the service polls the marks once per interval.
            std::thread::sleep(every);
            // The pool's leader heals; the others stand by.
            if !manager.is_leader() {
                clients.clear();
                continue;
            }
            let defs: Vec<VolumeDef> = manager
                .load_all()
                .into_iter()
                .filter(|d| d.state == VolState::Started && d.replica > 1)
                .collect();
            clients.retain(|name, _| defs.iter().any(|d| &d.name == name));
            for def in &defs {
                round(&manager, def, &mut clients);
            }
        }
    };
    if let Err(e) = std::thread::Builder::new()
        .name("kilnd-heal".into())
        .spawn(run)
    {
        tracing::error!("cannot start the heal service: {e}");
    }
}

fn round(manager: &Manager, def: &VolumeDef, clients: &mut HashMap<String, Client>) {
    let healer = manager.healer();
    let ports: Vec<(String, Option<u16>)> = def.bricks.iter().map(|b| (b.spec(), b.port)).collect();
    let stale = clients
        .get(&def.name)
        .is_none_or(|c| c.id != def.id || c.ports != ports);
    if stale {
        clients.remove(&def.name);
        match connect(manager, def) {
            Ok(vol) => {
                clients.insert(
                    def.name.clone(),
                    Client {
                        id: def.id.clone(),
                        ports,
                        vol,
                    },
                );
            }
            Err(e) => {
                healer.update(&def.name, |v| v.last_error = Some(e.to_string()));
                return;
            }
        }
    }
    let vol = &clients[&def.name].vol;
    let need = kiln_layer::exec::block_on(heal::info(vol.top()));
    let now = || {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    };
    let rebuild = heal::new_bricks(vol.top()).iter().any(|(_, up)| *up);
    if def.widening.is_some() && all_members(vol.top()) {
        manager.widening_done(&def.name);
    }
    if !need.iter().any(|n| n.target_up) && !rebuild {
        healer.update(&def.name, |v| {
            v.backlog = need.len() as u64;
            v.last_round = now();
        });
        return;
    }
    tracing::info!(volume = %def.name, files = need.len(), "heal service: healing");
    let board = healer.board(&def.name);
    let healed = |n: &heal::Need, bytes| {
        tracing::info!(volume = %def.name, file = %n.path, replica = %n.target_name, bytes,
            "healed");
    };
    let report = kiln_layer::exec::block_on(heal::run_with(vol.top(), &healed, &board));
    let left = kiln_layer::exec::block_on(heal::info(vol.top())).len() as u64;
    healer.update(&def.name, |v| {
        v.backlog = left;
        v.healed_files += report.files;
        v.healed_bytes += report.bytes;
        v.rounds += 1;
        v.last_round = now();
        v.last_error = report.errors.first().cloned();
    });
}

fn connect(manager: &Manager, def: &VolumeDef) -> Result<kiln_client::Volume, Error> {
    let volfile = manager.client_volfile_here(def)?;
    let key = manager.service_key(&def.name);
    kiln_client::Volume::from_volfile_with_secret(&volfile, Some(key.as_bytes()))
        .with_context(|| format!("heal service cannot reach the bricks of {}", def.name))
}

/// Whether every replica of the stack is up and a member (none new): a volume whose replica
/// count was raised has finished rebuilding.
fn all_members(top: &kiln_layer::LayerRef) -> bool {
    heal::replicate_layers(top)
        .iter()
        .flat_map(|l| l.graph_children())
        .all(|k| k.up() && !k.joining())
}
