//! Network namespaces for multi-host tests: [`ip`] runs `ip(8)`, and [`Veth`] is a namespace
//! joined to this one by a veth pair whose link a test can take down (a partition without
//! touching anything else), removed with what runs in it when dropped.

use std::io;
use std::process::Command;

/// Runs `ip ARGS`; the error says which command failed and why.
pub fn ip(args: &[&str]) -> io::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot run ip: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// A command that runs `program` in network namespace `ns` (through `ip netns exec`), or in
/// this one with `None`.
pub fn command_in(ns: Option<&str>, program: impl AsRef<std::ffi::OsStr>) -> Command {
    match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(program);
            c
        }
        None => Command::new(program),
    }
}

/// A network namespace joined to this one by a veth pair: this side at `near_ip`, the
/// namespace at `far_ip`, on a /30 of its own. Dropping it removes the pair and the
/// namespace.
pub struct Veth {
    /// The namespace's name (for `ip netns exec`).
    pub ns: String,
    /// This side's interface.
    pub near: String,
    /// This side's address.
    pub near_ip: String,
    /// The namespace's address.
    pub far_ip: String,
}

impl Veth {
    /// A pair named after `tag` (at most 6 characters) and this process, on a free /30 in
    /// `10.NET.0.0/16`. The subnet is chosen under a lock on a file in the temporary
    /// directory, from the addresses this namespace has, so tests in other processes (a test
    /// runner starts each test in its own) never get the same one.
    pub fn new(tag: &str, net: u8) -> io::Result<Veth> {
        assert!(tag.len() <= 6, "interface names are at most 15 bytes");
        let id = std::process::id();
        let lock_path = std::env::temp_dir().join("kiln-testkit-veth.lock");
        let lock = std::fs::File::create(&lock_path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", lock_path.display())))?;
        lock.lock()?;
        let base = free_subnet(net, id)?;
        let v = Veth {
            ns: format!("{tag}{id}"),
            near: format!("{tag}{id}a"),
            near_ip: format!("{base}.1"),
            far_ip: format!("{base}.2"),
        };
        let far = format!("{tag}{id}b");
        ip(&["netns", "add", &v.ns])?;
        ip(&["link", "add", &v.near, "type", "veth", "peer", "name", &far])?;
        ip(&["link", "set", &far, "netns", &v.ns])?;
        ip(&["addr", "add", &format!("{}/30", v.near_ip), "dev", &v.near])?;
        ip(&["link", "set", &v.near, "up"])?;
        drop(lock); // the address is in place: the next caller sees it
        let far_addr = format!("{}/30", v.far_ip);
        ip(&["-n", &v.ns, "addr", "add", &far_addr, "dev", &far])?;
        ip(&["-n", &v.ns, "link", "set", &far, "up"])?;
        ip(&["-n", &v.ns, "link", "set", "lo", "up"])?;
        Ok(v)
    }

    /// Takes this side's end of the link up or down.
    pub fn link(&self, up: bool) {
        ip(&["link", "set", &self.near, if up { "up" } else { "down" }])
            .expect("set the veth link");
    }
}

/// The first three octets of a /30 in `10.NET.0.0/16` (fourth octet 0) that no address in
/// this namespace is in, starting from one derived from `id`.
fn free_subnet(net: u8, id: u32) -> io::Result<String> {
    let out = Command::new("ip")
        .args(["-o", "-4", "addr", "show"])
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot run ip: {e}")))?;
    let used = String::from_utf8_lossy(&out.stdout).into_owned();
    let start = id % 250;
    (0..250)
        .map(|k| format!("10.{net}.{}", (start + k) % 250))
        .find(|base| !used.contains(&format!(" {base}.")))
        .ok_or_else(|| io::Error::other(format!("no free /30 left in 10.{net}.0.0/16")))
}

impl Drop for Veth {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.near]);
        let _ = ip(&["netns", "del", &self.ns]);
    }
}

/// One IPv4 TCP socket as the kernel lists it (`/proc/net/tcp`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSocket {
    /// This end, `ip:port`.
    pub local: String,
    /// The other end, `ip:port`.
    pub remote: String,
    /// The state's name (`ESTABLISHED`, `FIN_WAIT1`, `TIME_WAIT`, …).
    pub state: &'static str,
    /// Bytes sent and not acknowledged yet.
    pub tx_queue: u64,
    /// Bytes received and not read by the process yet.
    pub rx_queue: u64,
}

/// The IPv4 TCP sockets of this network namespace, or of namespace `ns`.
pub fn tcp_sockets(ns: Option<&str>) -> io::Result<Vec<TcpSocket>> {
    let table = match ns {
        None => std::fs::read_to_string("/proc/net/tcp")?,
        Some(ns) => {
            let out = command_in(Some(ns), "cat").arg("/proc/net/tcp").output()?;
            if !out.status.success() {
                return Err(io::Error::other(format!(
                    "the socket table of {ns}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
    };
    Ok(table.lines().skip(1).filter_map(parse_tcp_line).collect())
}

/// `sl local rem st tx:rx …` with addresses as little-endian hex `IP:PORT`.
fn parse_tcp_line(line: &str) -> Option<TcpSocket> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let addr = |s: &str| -> Option<String> {
        let (ip, port) = s.split_once(':')?;
        let ip = u32::from_str_radix(ip, 16).ok()?;
        let port = u16::from_str_radix(port, 16).ok()?;
        Some(format!(
            "{}:{port}",
            std::net::Ipv4Addr::from(ip.swap_bytes())
        ))
    };
    let (tx, rx) = f.get(4)?.split_once(':')?;
    const STATES: [&str; 13] = [
        "?",
        "ESTABLISHED",
        "SYN_SENT",
        "SYN_RECV",
        "FIN_WAIT1",
        "FIN_WAIT2",
        "TIME_WAIT",
        "CLOSE",
        "CLOSE_WAIT",
        "LAST_ACK",
        "LISTEN",
        "CLOSING",
        "NEW_SYN_RECV",
    ];
    Some(TcpSocket {
        local: addr(f.get(1)?)?,
        remote: addr(f.get(2)?)?,
        state: STATES
            .get(usize::from_str_radix(f.get(3)?, 16).ok()?)
            .copied()?,
        tx_queue: u64::from_str_radix(tx, 16).ok()?,
        rx_queue: u64::from_str_radix(rx, 16).ok()?,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_socket_table_line_reads_as_its_addresses_and_queues() {
        let line =
            "   3: 0100007F:1F90 0200000A:D431 04 00001000:00000002 01:00000014 00000000     0 \
                    0 12345 1 0000000000000000 20 4 30 10 -1";
        let s = super::parse_tcp_line(line).expect("parses");
        assert_eq!(s.local, "127.0.0.1:8080");
        assert_eq!(s.remote, "10.0.0.2:54321");
        assert_eq!((s.state, s.tx_queue, s.rx_queue), ("FIN_WAIT1", 4096, 2));
    }
}
