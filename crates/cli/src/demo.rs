//! `kiln demo`: a local brick on a temporary directory, used for real through the client.

use std::sync::atomic::Ordering;
use std::time::Instant;

use kiln_client::{block_on, join_all, Volume};

use crate::bench::{self, BenchArgs, ChildServer, Rw, Transport};
use kiln_proto::error::Context as _;
use kiln_proto::Error;

/// Starts a brick server on a temporary directory, writes and reads real data through the
/// native client (verifying every byte), exercises the metadata fops, runs two short loads and
/// prints what it measured. Everything it made is removed at the end.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Bytes of data to write and read back (e.g. 256m).
    #[arg(long, default_value = "256m", value_parser = bench::parse_size)]
    pub size: u64,
    /// Seconds for each of the two short loads (at most a day).
    #[arg(long, value_name = "SECS", default_value_t = 3.0, value_parser = kiln_proto::seconds::up_to_a_day)]
    pub runtime: f64,
    /// Print one JSON object at the end instead of the steps as they happen: {"ok": true,
    /// "steps": {NAME: RESULT, …}, "loads": [{"rw", "bs", "iodepth", "mb_s", "iops",
    /// "p50_us", "p99_us"}, …], "bytes_copied"}.
    #[arg(long)]
    pub json: bool,
}

/// What the demo says: each step as it happens, or (`--json`) all of it at the end.
struct Out {
    json: bool,
    steps: serde_json::Map<String, serde_json::Value>,
    loads: Vec<serde_json::Value>,
}

impl Out {
    /// A step's result line, or its error.
    fn step(&mut self, name: &str, r: std::io::Result<String>) -> Result<(), Error> {
        match r {
            Ok(s) => {
                if self.json {
                    self.steps.insert(name.to_owned(), s.into());
                } else {
                    println!("  {name:<28} {s}");
                }
                Ok(())
            }
            Err(e) => Err(Error::failed(format!("{name}: {e}"))),
        }
    }

    /// A line for a person (none with `--json`).
    fn say(&self, line: &str) {
        if !self.json {
            println!("{line}");
        }
    }
}

fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// `kiln demo`.
pub fn main(args: DemoArgs) -> Result<(), Error> {
    let mut out = Out {
        json: args.json,
        steps: Default::default(),
        loads: Vec::new(),
    };
    let server = ChildServer::start(None, Transport::Tcp, None, |_| None)
        .context("cannot start the brick server")?;
    out.say(&format!(
        "kiln demo: brick server pid {} on {}",
        server.pid(),
        server.addr
    ));
    // The volume API: a client stack (io-stats → protocol-client) over the brick.
    let c = Volume::connect(&server.addr).map_err(Error::from)?;

    out.step(
        "mkdir demo",
        block_on(c.mkdir("demo", 0o755)).map(|a| format!("mode {:o}", a.mode)),
    )?;
    data(&c, &args, &mut out)?;

    metadata(&c, &mut out)?;

    for (rw, bs, qd) in [(Rw::Randread, 4096u64, 1usize), (Rw::Read, 128 << 10, 32)] {
        let a = bench_args(rw, bs, qd, &args, &server);
        let r = bench::run(&a, &server.addr, Some(server.pid())).map_err(Error::from)?;
        out.step(
            &format!("{:?} {}k QD{qd}", rw, bs / 1024).to_lowercase(),
            Ok(format!(
                "{:.0} MB/s, {:.0} IOPS, p50 {:.1} µs, p99 {:.1} µs",
                r.mb_s(),
                r.iops(),
                r.lat_us(0.5),
                r.lat_us(0.99)
            )),
        )?;
        out.loads.push(serde_json::json!({
            "rw": format!("{rw:?}").to_lowercase(), "bs": bs, "iodepth": qd,
            "mb_s": r.mb_s(), "iops": r.iops(), "p50_us": r.lat_us(0.5), "p99_us": r.lat_us(0.99),
        }));
        if let Some(w) = &r.waterfall {
            out.say(&format!(
                "  where a 4k read's time went ({} sampled requests, medians):",
                w.samples
            ));
            for line in w.render().lines() {
                out.say(&format!("    {line}"));
            }
        }
    }
    let copied: u64 = c
        .clients()
        .iter()
        .map(|k| k.stats().bytes_copied.load(Ordering::Relaxed))
        .sum();
    out.step(
        "bytes copied in user space",
        Ok(format!("{copied} (payload went socket <-> your buffers)")),
    )?;
    for p in ["demo/latest", "demo/image.raw"] {
        block_on(c.unlink(p)).map_err(Error::from)?;
    }
    block_on(c.rmdir("demo")).map_err(Error::from)?;
    out.say("kiln demo: done; the brick and its data are removed");
    if out.json {
        let r = serde_json::json!({
            "steps": out.steps,
            "loads": out.loads,
            "bytes_copied": copied,
        });
        crate::out::show(true, &r, |_| String::new());
    }
    Ok(())
}

/// Writes `args.size` bytes of generated data to a new file, reads them back in scattered
/// 4 KiB buffers and checks every byte.
fn data(c: &Volume, args: &DemoArgs, out: &mut Out) -> Result<(), Error> {
    let (fh, _) = block_on(c.create("demo/data.bin", libc::O_RDWR | libc::O_EXCL, 0o644))
        .map_err(Error::from)?;

    // Write: 1 MiB requests, 16 in flight. The data is made before the clock starts, so the
    // figure is the I/O's, not the generator's.
    let chunk = 1usize << 20;
    let chunks = (args.size as usize).div_ceil(chunk).max(1);
    let mut data: Vec<Vec<u8>> = (0..chunks)
        .map(|i| {
            let mut b = vec![0u8; chunk];
            fill(&mut b, i as u64);
            b
        })
        .collect();
    let t = Instant::now();
    let mut written = 0usize;
    let mut i = 0;
    while i < chunks {
        let batch: Vec<Vec<u8>> = data.drain(..16.min(data.len())).collect();
        let futs: Vec<_> = batch
            .into_iter()
            .enumerate()
            .map(|(k, b)| c.pwritev(&fh, vec![b], ((i + k) * chunk) as u64))
            .collect();
        i += futs.len();
        for (r, _) in join_all(futs) {
            written += r.context("write")?;
        }
    }
    block_on(c.fsync(&fh, false)).context("fsync")?;
    let wt = t.elapsed().as_secs_f64();
    out.step(
        "write + fsync",
        Ok(format!(
            "{} MiB at {:.0} MB/s",
            written >> 20,
            written as f64 / 1e6 / wt
        )),
    )?;

    // Read back: each 1 MiB request scatters into 256 × 4 KiB buffers, 16 requests in flight;
    // verified after the clock stops.
    let t = Instant::now();
    let mut read = 0usize;
    let mut back: Vec<(usize, Vec<Vec<u8>>)> = Vec::with_capacity(chunks);
    for batch in (0..chunks).collect::<Vec<_>>().chunks(16) {
        let futs: Vec<_> = batch
            .iter()
            .map(|&i| c.preadv(&fh, vec![vec![0u8; 4096]; 256], (i * chunk) as u64))
            .collect();
        for (&i, (n, bufs)) in batch.iter().zip(join_all(futs)) {
            let n = n.context("read")?;
            if n != chunk {
                return Err(Error::failed(format!(
                    "short read at offset {}: {n} bytes",
                    i * chunk
                )));
            }
            read += n;
            back.push((i, bufs));
        }
    }
    let rt = t.elapsed().as_secs_f64();
    let mut expect = vec![0u8; chunk];
    for (i, bufs) in &back {
        fill(&mut expect, *i as u64);
        if bufs.concat() != expect {
            return Err(Error::failed(format!(
                "data read back at offset {} differs from what was written",
                i * chunk
            )));
        }
    }
    drop(back);
    out.step(
        "read back + verify",
        Ok(format!(
            "{} MiB at {:.0} MB/s, every byte matches",
            read >> 20,
            read as f64 / 1e6 / rt
        )),
    )?;
    block_on(c.close(fh)).map_err(Error::from)?;
    Ok(())
}

/// The metadata fops, on the file the data steps wrote.
fn metadata(c: &Volume, out: &mut Out) -> Result<(), Error> {
    out.step(
        "setxattr/getxattr",
        (|| {
            block_on(c.setxattr("demo/data.bin", "user.kiln.demo", b"fired", 0))?;
            let v = block_on(c.getxattr("demo/data.bin", "user.kiln.demo"))?;
            Ok(format!(
                "user.kiln.demo = {:?}",
                String::from_utf8_lossy(&v)
            ))
        })(),
    )?;
    out.step(
        "rename + symlink",
        (|| {
            block_on(c.rename("demo/data.bin", "demo/image.raw", 0))?;
            block_on(c.symlink("image.raw", "demo/latest"))?;
            Ok(format!(
                "demo/latest -> {}",
                block_on(c.readlink("demo/latest"))?
            ))
        })(),
    )?;
    out.step(
        "readdir demo",
        block_on(c.readdir("demo")).map(|es| {
            es.iter()
                .map(|e| format!("{} ({} B)", e.name, e.attr.size))
                .collect::<Vec<_>>()
                .join(", ")
        }),
    )?;
    out.step(
        "statfs",
        block_on(c.statfs("")).map(|s| format!("{} MiB free", (s.bavail * s.frsize) >> 20)),
    )?;
    Ok(())
}

/// The `kiln bench` run the demo makes: `rw` of `bs` bytes at queue depth `qd` against the
/// demo's brick.
fn bench_args(rw: Rw, bs: u64, qd: usize, args: &DemoArgs, server: &ChildServer) -> BenchArgs {
    BenchArgs {
        rw,
        bs,
        iodepth: qd,
        size: args.size.max(bs),
        numjobs: 1,
        runtime: args.runtime,
        transport: Transport::Tcp,
        brick: None,
        connect: Some(server.addr.clone()),
        server_pid: Some(server.pid()),
        file: "demo/image.raw".into(),
        json: false,
        profile_points: false,
        // Sample the latency run: the demo shows where a 4k read's time goes.
        trace_every: if qd == 1 { 10 } else { 0 },
        delay_read_us: None,
        bare: false,
        switch: false,
        replica: 1,
        tls: None,
        short_circuit: kiln_fuse::Switch::On,
    }
}
