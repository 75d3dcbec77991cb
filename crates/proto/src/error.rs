//! The error every Kiln crate returns across its public edge: a [`Kind`] a caller can match
//! (retry what is [`Kind::Unavailable`], fix what is [`Kind::Invalid`], …) and a sentence for
//! the operator. The crates share one vocabulary of kinds, so each edge maps them once: the
//! CLI to its exit status, the management port to the `kind` of a failed reply, and back.
//!
//! Context is added as a prefix that keeps the kind: `e.context("volume start vm")` turns
//! "no such volume" into "volume start vm: no such volume", still [`Kind::NotFound`].

use std::fmt;
use std::io;

/// What went wrong, as a caller decides what to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// The request itself is wrong: a malformed value, an option out of range, a usage error.
    /// Asking again unchanged fails again.
    Invalid,
    /// What was named does not exist: a volume, an identity, a file, a brick.
    NotFound,
    /// What was to be made exists already.
    Exists,
    /// The thing is in a state that refuses this now (a volume not started, a rebalance under
    /// way, a brick still in use); another command can change that.
    Conflict,
    /// Someone that must answer cannot now: no pool leader, a peer unreachable, a timeout.
    /// The same request may succeed later.
    Unavailable,
    /// The identity that asked may not do this (or could not prove who it is).
    Denied,
    /// A local system call failed (disk, file system, process).
    Io,
    /// Anything else: a reply that makes no sense, a bug. Say what happened.
    Failed,
}

impl Kind {
    /// Every kind, for tables and tests.
    pub const ALL: [Kind; 8] = [
        Kind::Invalid,
        Kind::NotFound,
        Kind::Exists,
        Kind::Conflict,
        Kind::Unavailable,
        Kind::Denied,
        Kind::Io,
        Kind::Failed,
    ];

    /// The kind's name on the wire and in `--json` (`not-found`).
    pub fn name(self) -> &'static str {
        match self {
            Kind::Invalid => "invalid",
            Kind::NotFound => "not-found",
            Kind::Exists => "exists",
            Kind::Conflict => "conflict",
            Kind::Unavailable => "unavailable",
            Kind::Denied => "denied",
            Kind::Io => "io",
            Kind::Failed => "failed",
        }
    }

    /// The kind named `name`; an unknown name (a newer peer's) is [`Kind::Failed`].
    pub fn from_name(name: &str) -> Kind {
        Kind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .unwrap_or(Kind::Failed)
    }

    /// The kind of an I/O error.
    pub fn of_io(e: &io::Error) -> Kind {
        match e.kind() {
            io::ErrorKind::NotFound => Kind::NotFound,
            io::ErrorKind::AlreadyExists => Kind::Exists,
            io::ErrorKind::PermissionDenied => Kind::Denied,
            io::ErrorKind::InvalidInput => Kind::Invalid,
            io::ErrorKind::TimedOut
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::NotConnected
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::HostUnreachable
            | io::ErrorKind::NetworkUnreachable => Kind::Unavailable,
            _ => Kind::Io,
        }
    }
}

/// A failure: its [`Kind`] and the operator's sentence (and the system's error number, when a
/// system call failed, for callers whose edge speaks errno: libkiln, FUSE).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: Kind,
    msg: String,
    os: Option<i32>,
    /// The kind of the I/O error this came from, so that it goes back as it came.
    io: Option<io::ErrorKind>,
}

/// A result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error of `kind` saying `msg`.
    pub fn new(kind: Kind, msg: impl Into<String>) -> Error {
        Error {
            kind,
            msg: msg.into(),
            os: None,
            io: None,
        }
    }

    /// [`Kind::Invalid`].
    pub fn invalid(msg: impl Into<String>) -> Error {
        Error::new(Kind::Invalid, msg)
    }

    /// [`Kind::NotFound`].
    pub fn not_found(msg: impl Into<String>) -> Error {
        Error::new(Kind::NotFound, msg)
    }

    /// [`Kind::Exists`].
    pub fn exists(msg: impl Into<String>) -> Error {
        Error::new(Kind::Exists, msg)
    }

    /// [`Kind::Conflict`].
    pub fn conflict(msg: impl Into<String>) -> Error {
        Error::new(Kind::Conflict, msg)
    }

    /// [`Kind::Unavailable`].
    pub fn unavailable(msg: impl Into<String>) -> Error {
        Error::new(Kind::Unavailable, msg)
    }

    /// [`Kind::Denied`].
    pub fn denied(msg: impl Into<String>) -> Error {
        Error::new(Kind::Denied, msg)
    }

    /// [`Kind::Failed`].
    pub fn failed(msg: impl Into<String>) -> Error {
        Error::new(Kind::Failed, msg)
    }

    /// `e`, said as `what: e`, with the kind of its [`io::ErrorKind`].
    pub fn io(what: impl fmt::Display, e: &io::Error) -> Error {
        Error::from_io(e, format!("{what}: {e}"))
    }

    /// `e`'s kind, errno and io kind, saying `msg`. An [`Error`] that travelled inside `e`
    /// (through an `io::Result` edge) keeps its own kind.
    fn from_io(e: &io::Error, msg: String) -> Error {
        if let Some(inner) = e.get_ref().and_then(|r| r.downcast_ref::<Error>()) {
            return Error {
                msg,
                ..inner.clone()
            };
        }
        Error {
            os: e.raw_os_error(),
            io: Some(e.kind()),
            ..Error::new(Kind::of_io(e), msg)
        }
    }

    /// What went wrong.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The sentence, without the kind.
    pub fn message(&self) -> &str {
        &self.msg
    }

    /// The same error said as `what: …`.
    pub fn context(self, what: impl fmt::Display) -> Error {
        Error {
            msg: format!("{what}: {}", self.msg),
            ..self
        }
    }

    /// The system's error number, when a system call failed.
    pub fn raw_os_error(&self) -> Option<i32> {
        self.os
    }

    /// The same error, of kind `kind` (the errno and io kind it came from stay, and are what
    /// an `io::Error` made of it shows).
    pub fn with_kind(self, kind: Kind) -> Error {
        Error { kind, ..self }
    }

    /// The same error, carrying error number `n` (a peer's errno answer, say) for callers
    /// whose edge speaks errno.
    pub fn with_errno(self, n: i32) -> Error {
        Error {
            os: Some(n),
            ..self
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Error {}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Error {
        Error::from_io(&e, e.to_string())
    }
}

impl From<Error> for io::Error {
    /// For callers whose edge is `io::Result`: the [`io::ErrorKind`] it came from (or its
    /// errno's, or the nearest to its kind), with the error itself inside, sentence and errno
    /// included (`get_ref` and downcast to read the errno: libkiln returns it).
    fn from(e: Error) -> io::Error {
        if let Some(n) = e.os {
            return io::Error::new(io::Error::from_raw_os_error(n).kind(), e);
        }
        if let Some(k) = e.io {
            return io::Error::new(k, e);
        }
        let kind = match e.kind {
            Kind::Invalid => io::ErrorKind::InvalidInput,
            Kind::NotFound => io::ErrorKind::NotFound,
            Kind::Exists => io::ErrorKind::AlreadyExists,
            Kind::Denied => io::ErrorKind::PermissionDenied,
            Kind::Unavailable => io::ErrorKind::TimedOut,
            Kind::Conflict | Kind::Io | Kind::Failed => io::ErrorKind::Other,
        };
        io::Error::new(kind, e)
    }
}

/// Adds context to a failed result, keeping its kind.
pub trait Context<T> {
    /// `Err(e)` becomes `Err(e.context(what))`.
    fn context(self, what: impl fmt::Display) -> Result<T>;
    /// As [`Context::context`], with the prefix made only on failure.
    fn with_context<D: fmt::Display>(self, what: impl FnOnce() -> D) -> Result<T>;
}

impl<T, E: Into<Error>> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl fmt::Display) -> Result<T> {
        self.map_err(|e| e.into().context(what))
    }

    fn with_context<D: fmt::Display>(self, what: impl FnOnce() -> D) -> Result<T> {
        self.map_err(|e| e.into().context(what()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_cross_the_wire_by_name_and_unknown_ones_are_failures() {
        for k in Kind::ALL {
            assert_eq!(Kind::from_name(k.name()), k);
        }
        assert_eq!(Kind::from_name("from-a-newer-peer"), Kind::Failed);
    }

    #[test]
    fn context_is_a_prefix_that_keeps_the_kind() {
        let e: Result<()> = Err(Error::not_found("no such volume"));
        let e = e.context("volume start vm").unwrap_err();
        assert_eq!(e.kind(), Kind::NotFound);
        assert_eq!(e.to_string(), "volume start vm: no such volume");
        let io = io::Error::from(io::ErrorKind::PermissionDenied);
        assert_eq!(Error::io("open /x", &io).kind(), Kind::Denied);
        // A system call's error number and sentence survive the trip through Error and back.
        let refused = io::Error::from_raw_os_error(111);
        let e = Error::io("connect", &refused).context("kilnd at 127.0.0.1:1");
        assert_eq!(e.kind(), Kind::Unavailable);
        let back = io::Error::from(e);
        assert_eq!(back.kind(), io::ErrorKind::ConnectionRefused);
        assert!(
            back.to_string()
                .starts_with("kilnd at 127.0.0.1:1: connect: "),
            "{back}"
        );
        let inner = back.get_ref().and_then(|r| r.downcast_ref::<Error>());
        assert_eq!(inner.and_then(Error::raw_os_error), Some(111));
        let refused = io::Error::new(io::ErrorKind::ConnectionRefused, "cannot reach kilnd");
        let back = io::Error::from(Error::from(refused));
        assert_eq!(back.kind(), io::ErrorKind::ConnectionRefused);
    }
}
