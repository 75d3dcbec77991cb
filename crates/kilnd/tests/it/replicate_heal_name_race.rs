//! A client's change of a name's attributes that races heal of that name: it reaches the
//! replica being healed after heal began its session there but before heal's lock, and the
//! replicas heal copies from only after heal read them (their copy waits on heal's lock).
//! Heal must not undo it on the healed replica: its session records what the client touched,
//! and heal's copy leaves that out. Three real brick processes; the healed one takes heal's
//! lock requests late (a delay-gen on `HealLock`), which opens the window every time.

use std::os::unix::fs::PermissionsExt;

use kiln_client::Volume;
use kiln_layer::exec::block_on;
use kiln_layer::heal;
use kiln_proto::ops::SETATTR_MODE;
use kiln_proto::Op;

use crate::replica;
use replica::{calls, counted, index_empty, volfile, wait_for, Brick};

fn chmod(vol: &Volume, path: &str, mode: u32) {
    let a = kiln_layer::SetAttrs {
        valid: SETATTR_MODE,
        mode,
        ..Default::default()
    };
    block_on(vol.setattr(path, a)).expect("chmod");
}

#[test]
fn a_chmod_racing_heal_of_the_name_is_not_undone_on_the_healed_replica() {
    let root = tempfile::tempdir().unwrap();
    // Replica 2 is the one healed; its heal locks arrive 400 ms late.
    let mut bricks: Vec<Brick> = (0..3)
        .map(|i| {
            let late = (i == 2).then_some((400_000, 1.0));
            Brick::delayed(root.path(), i, &["HealLock"], late)
        })
        .collect();
    let vol = Volume::from_volfile(&volfile(&bricks)).expect("connect");
    let (fd, _) = block_on(vol.create("f", libc::O_CREAT | libc::O_RDWR, 0o644)).unwrap();
    block_on(vol.close(fd)).unwrap();
    // Replica 2 misses a chmod: the others flag the name's attributes for it.
    bricks[2].kill9();
    chmod(&vol, "f", 0o600);
    bricks[2].start();
    let rep = heal::replicate_layers(vol.top()).remove(0);
    wait_for("the client to reconnect", 30, || rep.children()[2].up());

    let healer = Volume::from_volfile(&counted(&bricks)).expect("healer connects");
    let begun = calls("stats-2", Op::HealSession);
    let report = std::thread::scope(|s| {
        let h = s.spawn(|| block_on(heal::run(healer.top(), &|_, _| {})));
        // Once heal's session on replica 2 has begun (its lock there is on its way, late),
        // the client changes the mode: replica 2 takes it now, the others after heal's lock.
        wait_for("heal to begin its session on replica 2", 30, || {
            calls("stats-2", Op::HealSession) > begun
        });
        chmod(&vol, "f", 0o640);
        h.join().expect("heal")
    });
    assert!(report.errors.is_empty(), "heal errors {:?}", report.errors);
    let modes: Vec<u32> = bricks
        .iter()
        .map(|b| {
            std::fs::metadata(b.dir.join("f"))
                .unwrap()
                .permissions()
                .mode()
                & 0o7777
        })
        .collect();
    assert_eq!(
        modes,
        vec![0o640; 3],
        "the replicas' modes (heal undid the client's chmod on the one it healed?)"
    );
    assert!(index_empty(&healer), "marks remain after heal");
}
