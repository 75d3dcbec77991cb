//! The argument codec: a small, bounded, little-endian encoding for fop arguments.
//!
//! Integers are fixed width little endian. Byte strings and UTF-8 strings carry a u32 length
//! prefix; sequences carry a u32 count. Every length is checked against a limit and against the
//! bytes that remain before anything is allocated, so hostile input costs at most its own size.
//! Decoding never panics.

/// Longest path (or other string) a peer may send, in bytes: four times Linux's `PATH_MAX`.
/// A volume path can be longer than one system call's path (a deep tree reached through
/// relative paths); the brick resolves such a path in pieces. Two of them (a rename) still fit
/// in [`crate::frame::MAX_ARGS_LEN`].
pub const MAX_PATH_LEN: usize = 4 * 4096;
/// Longest byte string (xattr value, symlink target) a peer may send.
pub const MAX_BYTES_LEN: usize = 64 * 1024;

/// Why an argument block was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    /// The block ended before the value did.
    Truncated,
    /// A length prefix above its limit.
    TooLong,
    /// A string that is not UTF-8 or holds a NUL byte.
    BadString,
    /// Bytes left over after the last field.
    Trailing,
    /// A value outside its type's range (a boolean other than 0 or 1).
    BadValue,
}

impl core::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            DecodeError::Truncated => "arguments truncated",
            DecodeError::TooLong => "argument length above limit",
            DecodeError::BadString => "string argument is not UTF-8 or contains NUL",
            DecodeError::Trailing => "trailing bytes after arguments",
            DecodeError::BadValue => "argument value out of range",
        })
    }
}

impl std::error::Error for DecodeError {}

/// Appends encoded values to a buffer.
#[derive(Debug, Default)]
pub struct Enc {
    /// The encoded bytes so far.
    pub buf: Vec<u8>,
}

/// Reads encoded values from a byte slice.
#[derive(Debug)]
pub struct Dec<'a> {
    rest: &'a [u8],
}

impl<'a> Dec<'a> {
    /// A decoder over `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Dec { rest: bytes }
    }

    /// The bytes not yet decoded.
    pub fn rest(&self) -> &'a [u8] {
        self.rest
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.rest.len() {
            return Err(DecodeError::Truncated);
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn take_array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len_prefix(&mut self, limit: usize) -> Result<usize, DecodeError> {
        let n = u32::decode(self)? as usize;
        if n > limit {
            return Err(DecodeError::TooLong);
        }
        if n > self.rest.len() {
            return Err(DecodeError::Truncated);
        }
        Ok(n)
    }
}

/// A value with a wire encoding.
pub trait Wire: Sized {
    /// Appends `self` to `e`.
    fn encode(&self, e: &mut Enc);
    /// Reads one value from `d`.
    fn decode(d: &mut Dec<'_>) -> Result<Self, DecodeError>;

    /// Encodes `self` into a fresh buffer.
    fn to_wire(&self) -> Vec<u8> {
        let mut e = Enc::default();
        self.encode(&mut e);
        e.buf
    }

    /// Decodes a whole argument block: trailing bytes are an error.
    fn from_wire(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut d = Dec::new(bytes);
        let v = Self::decode(&mut d)?;
        if !d.rest.is_empty() {
            return Err(DecodeError::Trailing);
        }
        Ok(v)
    }
}

macro_rules! wire_int {
    ($($t:ty),*) => {$(
        impl Wire for $t {
            fn encode(&self, e: &mut Enc) {
                e.buf.extend_from_slice(&self.to_le_bytes());
            }
            fn decode(d: &mut Dec<'_>) -> Result<Self, DecodeError> {
                Ok(<$t>::from_le_bytes(d.take_array()?))
            }
        }
    )*};
}
wire_int!(u8, u16, u32, u64, i64);

/// No arguments: encodes as nothing.
impl Wire for () {
    fn encode(&self, _: &mut Enc) {}
    fn decode(_: &mut Dec<'_>) -> Result<Self, DecodeError> {
        Ok(())
    }
}

/// Two values, one after the other: a control fop's request is `(path, arguments)`.
impl<A: Wire, B: Wire> Wire for (A, B) {
    fn encode(&self, e: &mut Enc) {
        self.0.encode(e);
        self.1.encode(e);
    }
    fn decode(d: &mut Dec<'_>) -> Result<Self, DecodeError> {
        Ok((A::decode(d)?, B::decode(d)?))
    }
}

impl Wire for bool {
    fn encode(&self, e: &mut Enc) {
        (*self as u8).encode(e)
    }
    /// Only 0 and 1: every value has exactly one encoding.
    fn decode(d: &mut Dec<'_>) -> Result<Self, DecodeError> {
        match u8::decode(d)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(DecodeError::BadValue),
        }
    }
}

impl Wire for String {
    fn encode(&self, e: &mut Enc) {
        debug_assert!(
            self.len() <= MAX_PATH_LEN,
            "string longer than the wire allows"
        );
        (self.len() as u32).encode(e);
        e.buf.extend_from_slice(self.as_bytes());
    }
    fn decode(d: &mut Dec<'_>) -> Result<Self, DecodeError> {
        let n = d.len_prefix(MAX_PATH_LEN)?;
        let s = core::str::from_utf8(d.take(n)?).map_err(|_| DecodeError::BadString)?;
        if s.contains('\0') {
            return Err(DecodeError::BadString);
        }
        Ok(s.to_owned())
    }
}

impl Wire for Vec<u8> {
    fn encode(&self, e: &mut Enc) {
        debug_assert!(
            self.len() <= MAX_BYTES_LEN,
            "byte string longer than the wire allows"
        );
        (self.len() as u32).encode(e);
        e.buf.extend_from_slice(self);
    }
    fn decode(d: &mut Dec<'_>) -> Result<Self, DecodeError> {
        let n = d.len_prefix(MAX_BYTES_LEN)?;
        Ok(d.take(n)?.to_vec())
    }
}

/// A sequence of values; the count is bounded by the bytes that remain (every element takes at
/// least one byte), so a hostile count cannot make the decoder allocate.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Seq<T>(pub Vec<T>);

impl<T: Wire> Wire for Seq<T> {
    fn encode(&self, e: &mut Enc) {
        (self.0.len() as u32).encode(e);
        for v in &self.0 {
            v.encode(e);
        }
    }
    fn decode(d: &mut Dec<'_>) -> Result<Self, DecodeError> {
        let n = u32::decode(d)? as usize;
        if n > d.rest.len() {
            return Err(DecodeError::TooLong);
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(T::decode(d)?);
        }
        Ok(Seq(out))
    }
}

/// Declares wire structs: each field is encoded in order.
#[macro_export]
macro_rules! wire_struct {
    ($(
        $(#[$m:meta])*
        pub struct $name:ident { $( $(#[$fm:meta])* pub $f:ident : $t:ty ),* $(,)? }
    )*) => {
        $(
            $(#[$m])*
            #[derive(Debug, Clone, PartialEq, Eq, Default)]
            pub struct $name { $( $(#[$fm])* pub $f: $t ),* }

            impl $crate::codec::Wire for $name {
                #[allow(unused_variables)]
                fn encode(&self, e: &mut $crate::codec::Enc) {
                    $( $crate::codec::Wire::encode(&self.$f, e); )*
                }
                #[allow(unused_variables)]
                fn decode(d: &mut $crate::codec::Dec<'_>) -> Result<Self, $crate::codec::DecodeError> {
                    Ok($name { $( $f: $crate::codec::Wire::decode(d)? ),* })
                }
            }
        )*

        /// Every wire struct this module declares, by name, with its round-trip check
        /// ([`crate::codec::check_roundtrip`]): the fuzzer takes its cases from these lists.
        pub const WIRE_TYPES: &[(&str, fn(&[u8]))] =
            &[$( (stringify!($name), $crate::codec::check_roundtrip::<$name>) ),*];
    };
}

/// Decodes `bytes` as a `T`; a value it accepts must encode back to the same bytes (this
/// panics, naming the type, if not).
pub fn check_roundtrip<T: Wire + PartialEq + std::fmt::Debug>(bytes: &[u8]) {
    if let Ok(v) = T::from_wire(bytes) {
        assert_eq!(
            v.to_wire(),
            bytes,
            "{}: re-encoding differs",
            std::any::type_name::<T>()
        );
    }
}
