//! 1-byte ping-pong over loopback TCP (or a Unix socket pair with `--unix`).
//!
//! This is the latency floor that Kiln's 4k QD1 read is compared against: a
//! server thread echoes every byte it gets back on the same stream, and the
//! client times each write-then-read round trip. The result is one JSON line
//! on stdout with latency percentiles in microseconds.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::thread;
use std::time::Instant;

const DEFAULT_ITERATIONS: usize = 20_000;
const DEFAULT_WARMUP: usize = 1_000;

const USAGE: &str = "\
kiln-pingpong: 1-byte round-trip latency over loopback

usage: kiln-pingpong [--iterations N] [--warmup N] [--unix] [--cpus S,C]

  --iterations N  timed round trips (default 20000)
  --warmup N      untimed round trips before timing starts (default 1000)
  --unix          use a Unix socket pair instead of TCP on 127.0.0.1
  --cpus S,C      pin the echo thread to CPU S and the timing thread to CPU C
                  (S == C: both on one CPU; default: the scheduler decides)
  -h, --help      show this help

Both TCP ends set TCP_NODELAY. Prints one JSON line:
  {\"test\":\"tcp_pingpong\",\"iterations\":N,\"p50_us\":..,\"p99_us\":..,\"p999_us\":..,\"mean_us\":..}
(\"unix_pingpong\" with --unix; with --cpus also \"cpus\":[S,C]).";

struct Options {
    iterations: usize,
    warmup: usize,
    unix: bool,
    /// (echo thread CPU, timing thread CPU)
    cpus: Option<(usize, usize)>,
}

fn parse_count(flag: &str, value: Option<String>) -> Result<usize, String> {
    let value = value.ok_or_else(|| format!("{flag} needs a value"))?;
    value
        .parse::<usize>()
        .map_err(|e| format!("{flag} {value:?}: {e}"))
}

fn parse_cpus(value: Option<String>) -> Result<(usize, usize), String> {
    let value = value.ok_or("--cpus needs a value like 0,1")?;
    let (server, client) = value
        .split_once(',')
        .ok_or_else(|| format!("--cpus {value:?}: expected SERVER,CLIENT"))?;
    let cpu = |s: &str| {
        s.trim()
            .parse::<usize>()
            .ok()
            .filter(|&c| c < CPU_SET_BITS)
            .ok_or_else(|| format!("--cpus {value:?}: bad CPU number {s:?}"))
    };
    Ok((cpu(server)?, cpu(client)?))
}

/// `Ok(None)` means help was asked for.
fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Option<Options>, String> {
    let mut opts = Options {
        iterations: DEFAULT_ITERATIONS,
        warmup: DEFAULT_WARMUP,
        unix: false,
        cpus: None,
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--iterations" | "-n" => opts.iterations = parse_count(&arg, args.next())?,
            "--warmup" => opts.warmup = parse_count(&arg, args.next())?,
            "--unix" => opts.unix = true,
            "--cpus" => opts.cpus = Some(parse_cpus(args.next())?),
            "-h" | "--help" => return Ok(None),
            other => {
                if let Some(v) = other.strip_prefix("--iterations=") {
                    opts.iterations = parse_count("--iterations", Some(v.to_string()))?;
                } else if let Some(v) = other.strip_prefix("--cpus=") {
                    opts.cpus = Some(parse_cpus(Some(v.to_string()))?);
                } else if let Some(v) = other.strip_prefix("--warmup=") {
                    opts.warmup = parse_count("--warmup", Some(v.to_string()))?;
                } else {
                    return Err(format!("unknown argument {other:?}"));
                }
            }
        }
    }
    if opts.iterations == 0 {
        return Err("--iterations must be at least 1".into());
    }
    Ok(Some(opts))
}

const CPU_SET_BITS: usize = 1024;

// glibc's sched_setaffinity(2) wrapper; std links libc on Linux already.
extern "C" {
    fn sched_setaffinity(pid: i32, cpusetsize: usize, mask: *const u64) -> i32;
}

/// Pin the calling thread to one CPU.
fn pin_to(cpu: usize) -> io::Result<()> {
    let mut mask = [0u64; CPU_SET_BITS / 64];
    mask[cpu / 64] |= 1 << (cpu % 64);
    // SAFETY: pid 0 means the calling thread; the mask is a valid, fully
    // initialised cpu_set_t-sized buffer that outlives the call.
    let rc = unsafe { sched_setaffinity(0, std::mem::size_of_val(&mask), mask.as_ptr()) };
    if rc == 0 {
        Ok(())
    } else {
        let err = io::Error::last_os_error();
        Err(io::Error::new(
            err.kind(),
            format!("pin to CPU {cpu}: {err}"),
        ))
    }
}

fn pin_opt(cpu: Option<usize>) -> io::Result<()> {
    cpu.map_or(Ok(()), pin_to)
}

/// Echo single bytes until the peer closes its end.
fn echo<S: Read + Write>(mut stream: S) -> io::Result<()> {
    let mut byte = [0u8; 1];
    loop {
        match stream.read(&mut byte) {
            Ok(0) => return Ok(()),
            Ok(_) => stream.write_all(&byte)?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

fn round_trip<S: Read + Write>(stream: &mut S, out: u8) -> io::Result<()> {
    let mut back = [0u8; 1];
    stream.write_all(&[out])?;
    stream.read_exact(&mut back)?;
    if back[0] != out {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("sent {out}, got {} back", back[0]),
        ));
    }
    Ok(())
}

/// Run the warm-up, then the timed round trips; returns each latency in ns.
fn measure<S: Read + Write>(stream: &mut S, opts: &Options) -> io::Result<Vec<u64>> {
    for i in 0..opts.warmup {
        round_trip(stream, i as u8)?;
    }
    let mut samples = Vec::with_capacity(opts.iterations);
    for i in 0..opts.iterations {
        let start = Instant::now();
        round_trip(stream, i as u8)?;
        samples.push(start.elapsed().as_nanos() as u64);
    }
    Ok(samples)
}

fn run_tcp(opts: &Options) -> io::Result<Vec<u64>> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let addr = listener.local_addr()?;
    let server_cpu = opts.cpus.map(|c| c.0);
    let server = thread::spawn(move || -> io::Result<()> {
        pin_opt(server_cpu)?;
        let (stream, _) = listener.accept()?;
        stream.set_nodelay(true)?;
        echo(stream)
    });
    pin_opt(opts.cpus.map(|c| c.1))?;
    let mut client = TcpStream::connect(addr)?;
    client.set_nodelay(true)?;
    let samples = measure(&mut client, opts);
    drop(client);
    join(server)?;
    samples
}

fn run_unix(opts: &Options) -> io::Result<Vec<u64>> {
    let (mut client, server_end) = UnixStream::pair()?;
    let server_cpu = opts.cpus.map(|c| c.0);
    let server = thread::spawn(move || {
        pin_opt(server_cpu)?;
        echo(server_end)
    });
    pin_opt(opts.cpus.map(|c| c.1))?;
    let samples = measure(&mut client, opts);
    drop(client);
    join(server)?;
    samples
}

fn join(handle: thread::JoinHandle<io::Result<()>>) -> io::Result<()> {
    handle
        .join()
        .map_err(|_| io::Error::other("echo thread panicked"))?
}

/// Nearest-rank percentile of sorted samples, in microseconds.
fn percentile_us(sorted: &[u64], q: f64) -> f64 {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    let idx = rank.clamp(1, sorted.len()) - 1;
    sorted[idx] as f64 / 1000.0
}

fn report(test: &str, cpus: Option<(usize, usize)>, mut samples: Vec<u64>) -> String {
    samples.sort_unstable();
    let total: u128 = samples.iter().map(|&ns| u128::from(ns)).sum();
    let mean_us = total as f64 / samples.len() as f64 / 1000.0;
    let pinned = cpus.map_or(String::new(), |(s, c)| format!(",\"cpus\":[{s},{c}]"));
    format!(
        "{{\"test\":\"{test}\",\"iterations\":{},\"p50_us\":{:.3},\"p99_us\":{:.3},\"p999_us\":{:.3},\"mean_us\":{:.3}{pinned}}}",
        samples.len(),
        percentile_us(&samples, 0.50),
        percentile_us(&samples, 0.99),
        percentile_us(&samples, 0.999),
        mean_us,
    )
}

fn main() -> ExitCode {
    let opts = match parse_args(std::env::args().skip(1)) {
        Ok(Some(opts)) => opts,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("kiln-pingpong: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let (test, result) = if opts.unix {
        ("unix_pingpong", run_unix(&opts))
    } else {
        ("tcp_pingpong", run_tcp(&opts))
    };
    match result {
        Ok(samples) => {
            println!("{}", report(test, opts.cpus, samples));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kiln-pingpong: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let sorted: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        assert_eq!(percentile_us(&sorted, 0.50), 500.0);
        assert_eq!(percentile_us(&sorted, 0.99), 990.0);
        assert_eq!(percentile_us(&sorted, 0.999), 999.0);
        assert_eq!(percentile_us(&[7000], 0.999), 7.0);
    }

    #[test]
    fn both_transports_round_trip() {
        let opts = Options {
            iterations: 50,
            warmup: 5,
            unix: false,
            cpus: Some((0, 0)),
        };
        assert_eq!(run_tcp(&opts).unwrap().len(), 50);
        assert_eq!(run_unix(&opts).unwrap().len(), 50);
    }

    #[test]
    fn args_parse() {
        let args = ["--iterations", "10", "--unix"].map(String::from);
        let opts = parse_args(args.into_iter()).unwrap().unwrap();
        assert_eq!((opts.iterations, opts.warmup, opts.unix), (10, 1000, true));
        assert!(parse_args(["--bogus".to_string()].into_iter()).is_err());
        let args = ["--cpus", "0,1"].map(String::from);
        let opts = parse_args(args.into_iter()).unwrap().unwrap();
        assert_eq!(opts.cpus, Some((0, 1)));
        assert!(parse_args(["--cpus=0".to_string()].into_iter()).is_err());
        assert!(parse_args(["--help".to_string()].into_iter())
            .unwrap()
            .is_none());
    }
}
