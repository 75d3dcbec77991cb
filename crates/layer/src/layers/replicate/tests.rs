//! Replicate over three in-process bricks (marks over posix).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Replicate;
use crate::exec::block_on;
use crate::layers::marks::Marks;
use crate::layers::posix::{brick::Brick, Posix};
use crate::{Ctx, IoBufs, Layer, LayerRef};

/// A brick whose "new, not yet a member" state the test sets.
struct Joiner {
    kids: Vec<LayerRef>,
    joining: Arc<AtomicBool>,
}

impl Layer for Joiner {
    fn name(&self) -> &str {
        "joiner"
    }
    fn children(&self) -> &[LayerRef] {
        &self.kids
    }
    fn joining(&self) -> bool {
        self.joining.load(Relaxed)
    }
}

#[test]
fn a_change_waits_to_learn_that_replicas_which_took_it_have_joined() {
    let tmp = tempfile::tempdir().unwrap();
    let flags: Vec<Arc<AtomicBool>> = (0..3).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let kids: Vec<LayerRef> = (0..3)
        .map(|i| {
            let dir = tmp.path().join(format!("b{i}"));
            std::fs::create_dir(&dir).unwrap();
            let posix: LayerRef =
                Arc::new(Posix::new("posix", Arc::new(Brick::open(&dir).unwrap())));
            let marks: LayerRef = Arc::new(Marks::new("marks", posix, &dir).unwrap());
            Arc::new(Joiner {
                kids: vec![marks],
                joining: flags[i].clone(),
            }) as LayerRef
        })
        .collect();
    let r = Replicate::new("rep", kids, None).with_timeout(Some(Duration::from_secs(10)));
    let cx = Ctx::NONE;
    let flags_rw = (libc::O_RDWR | libc::O_CREAT) as u32;
    let (fd, _) = block_on(r.create(&cx, "f", flags_rw, 0o644)).unwrap();
    // Replicas 1 and 2 take the write while this client still knows them as new: the write
    // has one member's word, and needs two — until the client learns they are members.
    flags[1].store(true, Relaxed);
    flags[2].store(true, Relaxed);
    let later = flags.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        later[1].store(false, Relaxed);
        later[2].store(false, Relaxed);
    });
    let t0 = Instant::now();
    let w = block_on(r.write(&cx, &fd, 0, IoBufs::owned(vec![b"joined".to_vec()])));
    assert_eq!(w.map(|w| w.n).ok(), Some(6), "the write failed");
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "counted replicas known as new"
    );
    t.join().unwrap();
    // Still new when the timeout passes: the write fails, and says so in time.
    let short =
        Replicate::new("rep", r.kids.clone(), None).with_timeout(Some(Duration::from_millis(300)));
    let (fd2, _) = block_on(short.create(&cx, "g", flags_rw, 0o644)).unwrap();
    flags[1].store(true, Relaxed);
    flags[2].store(true, Relaxed);
    let t0 = Instant::now();
    let w = block_on(short.write(&cx, &fd2, 0, IoBufs::owned(vec![b"x".to_vec()])));
    assert!(w.is_err(), "a write without a quorum of members succeeded");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "waited past the timeout"
    );
    block_on(r.release(&cx, fd)).unwrap();
    block_on(short.release(&cx, fd2)).unwrap();
}
