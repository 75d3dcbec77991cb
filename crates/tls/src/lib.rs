//! TLS for brick connections: mutual certificates with rustls, and a small CA to issue them.
//!
//! # Identity directories
//! Every party (brick, client, management daemon) has a directory with three PEM files:
//! `ca.pem` (the certificate authority both sides trust), `cert.pem` (its own certificate,
//! issued by that CA) and `key.pem` (its private key, mode 0600). [`init_ca`] makes a CA and
//! [`issue`] makes identity directories from it (`kiln tls init` / `kiln tls issue`). A brick
//! started with `--tls DIR` accepts only TLS clients whose certificate the CA issued; a client
//! uses TLS when `KILN_TLS_DIR` names its directory, and checks that the brick's certificate
//! names the host it dialled.
//!
//! # The data path under TLS
//! Kiln's data path works on sockets with `readv`, `sendmsg` and `sendfile`, and receives
//! reply payload straight into the caller's buffers. TLS cannot be zero-copy in user space
//! (plaintext only exists after decryption), so TLS mode keeps each side's heavy direction
//! in its own hands and hands the light one to a thread: rustls runs the handshake (TLS 1.3,
//! AES-GCM, certificates checked both ways) and hands over the traffic keys to our record
//! layer ([`record`]). A client's receive thread opens reply records in place and copies the
//! plaintext once into the caller's buffers ([`RecordReader`]); its requests go through a
//! Unix socket pair to a thread that seals them. A brick seals replies itself, reading file
//! data from the page cache straight into the record ([`RecordWriter`]); its requests arrive
//! through a thread that opens them onto a Unix socket pair. This costs copies that plaintext
//! mode does not pay (measured in `bench/tls.py`), which is why TLS is a choice and not the
//! default; the shared-secret handshake, which costs nothing after connect, is the default.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

pub use rustls::{ClientConfig, ServerConfig};

/// The CA certificate file in an identity directory.
pub const CA_FILE: &str = "ca.pem";
/// The certificate file in an identity directory.
pub const CERT_FILE: &str = "cert.pem";
/// The private key file in an identity directory.
pub const KEY_FILE: &str = "key.pem";
/// The CA's own private key (only in the directory made by [`init_ca`]).
pub const CA_KEY_FILE: &str = "ca.key";
/// The environment variable that makes clients use TLS: the client's identity directory.
pub const ENV_DIR: &str = "KILN_TLS_DIR";

/// The first byte of every TLS connection (a handshake record). Kiln frames never start with
/// it, which lets a TLS brick tell a plaintext client apart and answer it clearly.
pub const HANDSHAKE_RECORD: u8 = 0x16;

/// How long a handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

fn bad(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

fn load_certs(path: &Path) -> io::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            bad(format!(
                "cannot read certificates from {}: {e}",
                path.display()
            ))
        })?;
    if certs.is_empty() {
        return Err(bad(format!("no certificate in {}", path.display())));
    }
    Ok(certs)
}

fn load_key(path: &Path) -> io::Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        bad(format!(
            "cannot read a private key from {}: {e}",
            path.display()
        ))
    })
}

fn roots(dir: &Path) -> io::Result<Arc<rustls::RootCertStore>> {
    let mut roots = rustls::RootCertStore::empty();
    for c in load_certs(&dir.join(CA_FILE))? {
        roots
            .add(c)
            .map_err(|e| bad(format!("bad CA certificate in {}: {e}", dir.display())))?;
    }
    Ok(Arc::new(roots))
}

/// A brick's TLS configuration from its identity directory: its certificate, and clients must
/// present one issued by the directory's CA.
pub fn server_config(dir: &Path) -> io::Result<Arc<ServerConfig>> {
    let verifier = rustls::server::WebPkiClientVerifier::builder(roots(dir)?)
        .build()
        .map_err(|e| bad(format!("TLS client verifier from {}: {e}", dir.display())))?;
    let mut cfg = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(bad)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            load_certs(&dir.join(CERT_FILE))?,
            load_key(&dir.join(KEY_FILE))?,
        )
        .map_err(|e| bad(format!("TLS identity in {}: {e}", dir.display())))?;
    cfg.enable_secret_extraction = true;
    // Tickets would arrive after the handshake, inside the record stream Kiln carries itself.
    cfg.send_tls13_tickets = 0;
    Ok(Arc::new(cfg))
}

/// aws-lc-rs with the TLS 1.3 AES-GCM suites only: the ones [`record`] implements.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::aws_lc_rs::default_provider();
    p.cipher_suites.retain(|s| {
        matches!(
            s.suite(),
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
                | rustls::CipherSuite::TLS13_AES_256_GCM_SHA384
        )
    });
    Arc::new(p)
}

/// A client's TLS configuration from its identity directory: it trusts the directory's CA and
/// presents its own certificate.
pub fn client_config(dir: &Path) -> io::Result<Arc<ClientConfig>> {
    let mut cfg = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(bad)?
        .with_root_certificates(roots(dir)?)
        .with_client_auth_cert(
            load_certs(&dir.join(CERT_FILE))?,
            load_key(&dir.join(KEY_FILE))?,
        )
        .map_err(|e| bad(format!("TLS identity in {}: {e}", dir.display())))?;
    cfg.enable_secret_extraction = true;
    cfg.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(cfg))
}

/// The client configuration named by `KILN_TLS_DIR`, or `None` when it is not set.
pub fn client_config_from_env() -> io::Result<Option<Arc<ClientConfig>>> {
    match std::env::var_os(ENV_DIR) {
        Some(d) if !d.is_empty() => client_config(Path::new(&d))
            .map(Some)
            .map_err(|e| io::Error::new(e.kind(), format!("{ENV_DIR}: {e}"))),
        _ => Ok(None),
    }
}

/// The name a client checks the brick's certificate against: the host part of `HOST:PORT`.
pub fn server_name(host_port: &str) -> io::Result<ServerName<'static>> {
    let host = match host_port.rsplit_once(':') {
        Some((h, _)) => h,
        None => host_port,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_owned())
        .map_err(|e| bad(format!("{host:?} cannot name a TLS server: {e}")))
}

/// Runs the handshake and returns the two directions' ciphers.
fn establish(
    tcp: &mut TcpStream,
    mut conn: rustls::Connection,
) -> io::Result<(record::Cipher, record::Cipher, Option<String>)> {
    tcp.set_nonblocking(false)?;
    tcp.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    tcp.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    if let Err(e) = handshake(&mut conn, tcp) {
        return Err(io::Error::new(e.kind(), handshake_error(e)));
    }
    let peer = conn
        .peer_certificates()
        .and_then(|c| c.first())
        .and_then(|c| common_name(c.as_ref()));
    let secrets = conn.dangerous_extract_secrets().map_err(bad)?;
    tcp.set_read_timeout(None)?;
    tcp.set_write_timeout(None)?;
    Ok((
        record::Cipher::new(secrets.tx)?,
        record::Cipher::new(secrets.rx)?,
        peer,
    ))
}

/// The common name of a DER certificate (what `kiln tls issue NAME` puts there), if it has
/// exactly one.
fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let mut names = cert.subject().iter_common_name();
    let first = names.next()?.as_str().ok()?.to_owned();
    names.next().is_none().then_some(first)
}

/// A Unix socket pair with room for bursts; the first end is the helper thread's.
fn pair() -> io::Result<(UnixStream, UnixStream)> {
    let (mine, theirs) = UnixStream::pair()?;
    for s in [&mine, &theirs] {
        grow_buffers(s.as_fd());
    }
    Ok((mine, theirs))
}

/// A brick's TLS connection whose sending side its owner runs: requests arrive in plaintext
/// on `recv` (a thread opens them), and replies are sealed by `writer` and written to
/// `send`, the TCP socket itself.
pub struct SplitServer {
    /// Where requests arrive in plaintext.
    pub recv: OwnedFd,
    /// The TCP socket, to write sealed records to (and to shut down at the end, which also
    /// ends the receiving thread).
    pub send: OwnedFd,
    /// Seals the replies.
    pub writer: RecordWriter,
    /// The common name of the client's certificate (which its CA vouched for).
    pub peer_name: Option<String>,
}

/// Runs the server side of a handshake on `tcp` (blocking, at most 10 s), checking the
/// client's certificate, and returns the connection (see [`SplitServer`]).
pub fn accept_split(mut tcp: TcpStream, config: Arc<ServerConfig>) -> io::Result<SplitServer> {
    let conn = rustls::ServerConnection::new(config).map_err(bad)?;
    let (tx, rx, peer_name) = establish(&mut tcp, conn.into())?;
    let (mine, theirs) = pair()?;
    let net = tcp.try_clone()?;
    std::thread::Builder::new()
        .name("kiln-tls-rx".into())
        .spawn(move || record::receive_loop(rx, net, mine))?;
    Ok(SplitServer {
        recv: theirs.into(),
        send: tcp.into(),
        writer: RecordWriter::new(tx),
        peer_name,
    })
}

/// A client TLS connection whose receiving side its owner runs: plaintext to send goes into
/// `send` (a thread seals it onto the network), and replies are read from `recv`, the TCP
/// socket itself, through `reader`, straight into the owner's buffers.
pub struct Split {
    /// Where plaintext to send is written.
    pub send: OwnedFd,
    /// The TCP socket, to receive from with `reader` (and to shut down).
    pub recv: OwnedFd,
    /// Opens the records that arrive on `recv`.
    pub reader: RecordReader,
}

/// Runs the client side of a handshake on `tcp` (at most 10 s), checking the brick's
/// certificate against `name`, and returns the connection (see [`Split`]).
pub fn connect_split(
    mut tcp: TcpStream,
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
) -> io::Result<Split> {
    let conn = rustls::ClientConnection::new(config, name).map_err(bad)?;
    let (tx, rx, _) = establish(&mut tcp, conn.into())?;
    let (mine, theirs) = pair()?;
    let net = tcp.try_clone()?;
    std::thread::Builder::new()
        .name("kiln-tls-tx".into())
        .spawn(move || record::send_loop(tx, mine, net))?;
    Ok(Split {
        send: theirs.into(),
        recv: tcp.into(),
        reader: RecordReader::new(rx),
    })
}

/// A blocking connection to a Kiln port for short exchanges (management calls): plaintext,
/// or TLS through rustls's own stream (no split: these carry a few KiB, not the data path).
pub enum Blocking {
    /// Plaintext TCP.
    Plain(TcpStream),
    /// TLS over TCP, the handshake done.
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Blocking {
    /// With `config`, runs the client side of a handshake on `tcp` (checking that the peer's
    /// certificate names the host of `host_port`) before returning; without, plaintext.
    pub fn connect(
        mut tcp: TcpStream,
        config: Option<Arc<ClientConfig>>,
        host_port: &str,
    ) -> io::Result<Blocking> {
        let Some(config) = config else {
            return Ok(Blocking::Plain(tcp));
        };
        let mut conn =
            rustls::ClientConnection::new(config, server_name(host_port)?).map_err(bad)?;
        while conn.is_handshaking() {
            conn.complete_io(&mut tcp)
                .map_err(|e| io::Error::new(e.kind(), handshake_error(e)))?;
        }
        Ok(Blocking::Tls(Box::new(rustls::StreamOwned::new(conn, tcp))))
    }

    /// The TCP socket beneath (for timeouts and addresses).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Blocking::Plain(t) => t,
            Blocking::Tls(s) => &s.sock,
        }
    }
}

impl Read for Blocking {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Blocking::Plain(t) => t.read(buf),
            Blocking::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Blocking {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Blocking::Plain(t) => t.write(buf),
            Blocking::Tls(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Blocking::Plain(t) => t.flush(),
            Blocking::Tls(s) => s.flush(),
        }
    }
}

/// Drives a handshake to its end without reading a byte past it: records are read one at a
/// time, so application data that follows the last handshake record stays in the socket for
/// the record layer.
fn handshake(conn: &mut rustls::Connection, tcp: &mut TcpStream) -> io::Result<()> {
    let mut rec = Vec::with_capacity(record::MAX_RECORD);
    loop {
        while conn.wants_write() {
            conn.write_tls(tcp)?;
        }
        if !conn.is_handshaking() {
            return Ok(());
        }
        rec.resize(record::HEADER, 0);
        tcp.read_exact(&mut rec)?;
        let len = u16::from_be_bytes([rec[3], rec[4]]) as usize;
        if len > record::MAX_RECORD - record::HEADER {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                rustls::Error::InvalidMessage(rustls::InvalidMessage::MessageTooLarge),
            ));
        }
        rec.resize(record::HEADER + len, 0);
        tcp.read_exact(&mut rec[record::HEADER..])?;
        let mut src: &[u8] = &rec;
        while !src.is_empty() {
            conn.read_tls(&mut src)?;
            if let Err(e) = conn.process_new_packets() {
                let _ = conn.write_tls(tcp); // the alert
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
        }
    }
}

fn handshake_error(e: io::Error) -> String {
    if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut {
        return "TLS handshake timed out".into();
    }
    if e.kind() == io::ErrorKind::UnexpectedEof {
        return "the peer closed the connection during the TLS handshake \
                (it may not speak TLS, or it refused our certificate)"
            .into();
    }
    match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::InvalidMessage(_)) => {
            "TLS handshake failed: the peer does not speak TLS (a plaintext brick?)".into()
        }
        Some(r) => format!("TLS handshake failed: {r}"),
        None => format!("TLS handshake failed: {e}"),
    }
}

/// Both ends of the socket pair buffer a few chunks, so that bursts leave in one system call.
fn grow_buffers(fd: std::os::fd::BorrowedFd<'_>) {
    use rustix::net::sockopt;
    let size = 4 << 20;
    if sockopt::set_socket_send_buffer_size_force(fd, size).is_err() {
        let _ = sockopt::set_socket_send_buffer_size(fd, size);
    }
}

mod record;
pub use record::{RecordReader, RecordWriter};

/// Creates a new certificate authority in `dir` (`ca.pem`, and `ca.key` with mode 0600).
/// Refuses to overwrite an existing one.
pub fn init_ca(dir: &Path, name: &str) -> io::Result<()> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    std::fs::create_dir_all(dir)?;
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(bad)?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params.not_before = rcgen::date_time_ymd(2024, 1, 1);
    params.not_after = rcgen::date_time_ymd(2044, 1, 1);
    let key = KeyPair::generate().map_err(bad)?;
    let cert = params.self_signed(&key).map_err(bad)?;
    write_new(
        &dir.join(CA_KEY_FILE),
        key.serialize_pem().as_bytes(),
        0o600,
    )?;
    write_new(&dir.join(CA_FILE), cert.pem().as_bytes(), 0o644)?;
    Ok(())
}

/// Issues an identity directory `out` from the CA in `ca_dir`: a certificate for `name` that
/// also covers `alt_names` (host names and IP addresses a client may dial), valid for both
/// server and client use.
pub fn issue(ca_dir: &Path, out: &Path, name: &str, alt_names: &[String]) -> io::Result<PathBuf> {
    use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair};
    let ca_pem = std::fs::read_to_string(ca_dir.join(CA_FILE))?;
    let ca_key_pem = std::fs::read_to_string(ca_dir.join(CA_KEY_FILE)).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "cannot read the CA key {}: {e}",
                ca_dir.join(CA_KEY_FILE).display()
            ),
        )
    })?;
    let ca_key = KeyPair::from_pem(&ca_key_pem).map_err(bad)?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).map_err(bad)?;
    let mut sans: Vec<String> = vec![name.to_owned()];
    sans.extend(alt_names.iter().cloned());
    sans.dedup();
    let mut params = CertificateParams::new(sans).map_err(bad)?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.not_before = rcgen::date_time_ymd(2024, 1, 1);
    params.not_after = rcgen::date_time_ymd(2044, 1, 1);
    let key = KeyPair::generate().map_err(bad)?;
    let cert = params.signed_by(&key, &issuer).map_err(bad)?;
    std::fs::create_dir_all(out)?;
    write_new(&out.join(KEY_FILE), key.serialize_pem().as_bytes(), 0o600)?;
    write_new(&out.join(CERT_FILE), cert.pem().as_bytes(), 0o644)?;
    std::fs::write(out.join(CA_FILE), ca_pem)?;
    Ok(out.to_owned())
}

fn write_new(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    f.write_all(data)?;
    f.sync_all()
}
