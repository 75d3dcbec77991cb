//! The graphs kilnd hands out: a brick's stack, a volume's client stack, and the stack
//! behind the management port.

use std::net::SocketAddr;
use std::path::Path;

use crate::def::VolumeDef;
use kiln_layer::distribute::DistributeConfig;
use kiln_layer::faults::ErrorGenConfig;
use kiln_layer::layers::posix::PosixConfig;
use kiln_layer::replicate::ReplicateConfig;
use kiln_layer::shard::ShardConfig;
use kiln_layer::volfile::{LayerDef, LayerKind, ProtocolClientConfig, Volfile};
use kiln_proto::error::Context as _;
use kiln_proto::Error;

/// The volfile brick `index` of `def` runs: io-stats (`NAME-brick-N`) → marks (checking the
/// brick's identity: volume id and index) → dispatch → posix (squashing clients' root when
/// the volume says so), with the volume's options for those layers.
pub fn brick_volfile(def: &VolumeDef, index: usize, dir: &Path) -> Result<Volfile, Error> {
    let mut v = kiln_server::replica_volfile(dir, &format!("{}{BRICK_POINT}{index}", def.name));
    for l in &mut v.layers {
        match &mut l.kind {
            LayerKind::Posix(p) => p.root_squash = def.root_squash,
            LayerKind::Marks(m) => {
                m.identity = Some(kiln_layer::layers::marks::Identity {
                    volume_id: def.id.clone(),
                    brick: index as u32,
                });
                m.adopt = def.bricks.get(index).is_none_or(|b| !b.settled);
            }
            _ => {}
        }
    }
    crate::options::configure(def, &mut v)?;
    Ok(v)
}

/// What names a managed brick's io-stats point: `VOLUME-brick-INDEX`.
const BRICK_POINT: &str = "-brick-";

/// The volume and brick index a managed brick's io-stats point names, if it is one.
pub fn brick_of_point(point: &str) -> Option<(&str, usize)> {
    let (volume, index) = point.rsplit_once(BRICK_POINT)?;
    Some((volume, index.parse().ok()?))
}

/// The client volfile of a started volume: io-stats `NAME` → shard `NAME-shard` (when the
/// volume shards) → distribute `NAME-dht` (with more
/// than one replica set; those draining marked so) → replicate `NAME-replicate-K` (with
/// replica > 1) → protocol-client `NAME-client-N` for brick N. Removed sets are left out; the
/// others keep their numbers.
pub fn client_volfile(def: &VolumeDef) -> Result<Volfile, Error> {
    let name = &def.name;
    let mut clients = Vec::new();
    for (i, b) in def.bricks.iter().enumerate() {
        if b.removed {
            // A placeholder, dropped below: keeps `clients[i]` brick `i`.
            clients.push(LayerDef {
                name: format!("{name}-client-{i}"),
                subvolumes: Vec::new(),
                kind: LayerKind::ProtocolClient(ProtocolClientConfig::to(String::new())),
            });
            continue;
        }
        let port = b.port.ok_or_else(|| {
            Error::conflict(format!(
                "volume {name}: brick {} has no port yet (start the volume)",
                b.spec()
            ))
        })?;
        clients.push(LayerDef {
            name: format!("{name}-client-{i}"),
            subvolumes: Vec::new(),
            kind: LayerKind::ProtocolClient(ProtocolClientConfig {
                // A replica's connection does not wait: its replicate layer does.
                timeout: (def.replica <= 1).then_some(def.io_timeout).flatten(),
                ..ProtocolClientConfig::to(format!("tcp:{}", SocketAddr::new(b.ip()?, port)))
            }),
        });
    }
    let replica = def.replica.max(1);
    let sets = def.set_bricks();
    let live = def.live_sets();
    let mut layers = Vec::new();
    let mut set_tops = Vec::new();
    let mut replicates = Vec::new();
    let mut draining = Vec::new();
    for &k in &live {
        let top = if replica > 1 {
            let lname = format!("{name}-replicate-{k}");
            replicates.push(LayerDef {
                name: lname.clone(),
                subvolumes: sets[k].iter().map(|&i| clients[i].name.clone()).collect(),
                kind: LayerKind::Replicate(ReplicateConfig {
                    // Widening: the old bricks are the only members until the new are rebuilt.
                    quorum: def.widening.map(|r| (r / 2 + 1) as u32),
                    timeout: def.io_timeout,
                }),
            });
            lname
        } else {
            clients[sets[k][0]].name.clone()
        };
        if def.draining.contains(&k) {
            draining.push(top.clone());
        }
        set_tops.push(top);
    }
    // Removed bricks are in no graph.
    let kept: Vec<String> = live
        .iter()
        .flat_map(|&k| sets[k].iter().map(|&i| clients[i].name.clone()))
        .collect();
    clients.retain(|c| kept.contains(&c.name));
    let below_top = match set_tops.as_slice() {
        [] => return Err(Error::conflict(format!("volume {name}: no bricks left"))),
        [only] => only.clone(),
        _ => {
            layers.push(LayerDef {
                name: format!("{name}-dht"),
                subvolumes: set_tops,
                kind: LayerKind::Distribute(DistributeConfig { draining }),
            });
            format!("{name}-dht")
        }
    };
    let mut top = tops(def, below_top);
    top.append(&mut layers);
    let mut layers = top;
    layers.extend(replicates);
    layers.extend(clients);
    let mut v = Volfile { layers };
    crate::options::configure(def, &mut v)?;
    v.check().with_context(|| format!("volume {name}"))?;
    Ok(v)
}

/// The layers above the sets (or their distribute layer, named `below`): io-stats `NAME`,
/// then shard `NAME-shard` when the volume shards.
fn tops(def: &VolumeDef, below: String) -> Vec<LayerDef> {
    let name = &def.name;
    let mut out = vec![LayerDef {
        name: name.clone(),
        subvolumes: vec![below.clone()],
        kind: LayerKind::IoStats {},
    }];
    if let Some(block_size) = def.shard_block {
        out[0].subvolumes = vec![format!("{name}-shard")];
        out.push(LayerDef {
            name: format!("{name}-shard"),
            subvolumes: vec![below],
            kind: LayerKind::Shard(ShardConfig { block_size }),
        });
    }
    out
}

/// The stack behind the management port: every file fop fails (error-gen, ENOSYS) over an
/// empty directory; only HELLO and MGMT mean anything there.
pub fn placeholder_volfile(state_dir: &Path) -> Volfile {
    Volfile::linear(vec![
        (
            "mgmt".into(),
            LayerKind::ErrorGen(ErrorGenConfig {
                fops: Vec::new(),
                error: libc::ENOSYS.to_string(),
                probability: 1.0,
                seed: 1,
            }),
        ),
        (
            "mgmt-root".into(),
            LayerKind::Posix(PosixConfig::at(state_dir.join("mgmt-root"))),
        ),
    ])
}
