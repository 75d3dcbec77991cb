//! The challenge-response handshake every Kiln connection uses (bricks, the management port,
//! kilnd to kilnd), and the one HMAC behind it. Each side proves a key without sending it:
//!
//! 1. HELLO: the server answers with `auth_required` and a fresh 32-byte nonce.
//! 2. AUTH: the client names the identity it speaks for (empty: the compatibility identity, a
//!    volume's or the pool's shared secret), sends its own fresh nonce and
//!    `HMAC(key, client transcript)`.
//! 3. The server checks it (constant time) against that identity's key and answers
//!    `HMAC(key, server transcript)`, which the client checks in turn.
//!
//! The two transcripts differ in their label, so one side's proof is never valid for the other;
//! both nonces are in each, so a recorded exchange does not replay; and the identity's name is
//! in each, so a proof made for one identity never admits another that shares its key.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::ops::AuthReq;

/// Length of each side's nonce.
pub const NONCE_LEN: usize = 32;

/// Longest identity name (letters, digits, `.`, `-`, `_`; see [`check_identity`]).
pub const MAX_IDENTITY_LEN: usize = 72;

/// What a client proves: the identity it speaks for and that identity's key.
#[derive(Clone, PartialEq, Eq)]
pub struct Key {
    /// The identity's name; empty for the compatibility identity (a shared secret).
    pub identity: String,
    /// The key's bytes (as the key file holds them: text, without surrounding space).
    pub secret: Vec<u8>,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret: keys end up in logs through `{:?}` otherwise.
        f.debug_struct("Key")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl Key {
    /// The compatibility identity's key: a volume's (or the pool's) shared secret.
    pub fn shared(secret: &[u8]) -> Key {
        Key {
            identity: String::new(),
            secret: secret.to_vec(),
        }
    }

    /// The key a secret file's bytes name: [`Key::parse`] when they parse, else the bytes as
    /// they are as a shared secret (a secret file written by hand with any content).
    pub fn from_file_text(bytes: &[u8]) -> Key {
        std::str::from_utf8(bytes)
            .ok()
            .and_then(|t| Key::parse(t).ok())
            .unwrap_or_else(|| Key::shared(bytes))
    }

    /// Parses a key file's text: `SECRET` alone (the compatibility identity) or
    /// `NAME SECRET` (a named identity, as `kiln auth add --key-file` writes it).
    pub fn parse(text: &str) -> Result<Key, crate::Error> {
        let mut words = text.split_whitespace();
        let (identity, secret) = match (words.next(), words.next(), words.next()) {
            (Some(s), None, None) => (String::new(), s),
            (Some(n), Some(s), None) => {
                check_identity(n)?;
                (n.to_owned(), s)
            }
            (None, _, _) => return Err(crate::Error::invalid("the key file is empty")),
            _ => {
                return Err(crate::Error::invalid(
                    "a key file holds `SECRET` or `NAME SECRET`, nothing more",
                ))
            }
        };
        Ok(Key {
            identity,
            secret: secret.as_bytes().to_vec(),
        })
    }
}

/// Checks an identity name: 1 to [`MAX_IDENTITY_LEN`] letters, digits, `.`, `-` or `_`, not
/// starting with `.` or `-`.
pub fn check_identity(name: &str) -> Result<(), crate::Error> {
    let ok = !name.is_empty()
        && name.len() <= MAX_IDENTITY_LEN
        && !name.starts_with(['.', '-'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
    if ok {
        Ok(())
    } else {
        Err(crate::Error::invalid(format!(
            "bad identity name {name:?}: 1 to {MAX_IDENTITY_LEN} letters, digits, '.', '-' or \
             '_', not starting with '.' or '-'"
        )))
    }
}

/// HMAC-SHA256 of `msg` keyed with `key`.
pub fn mac(key: &[u8], msg: &[u8]) -> Vec<u8> {
    let mut m = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
    m.update(msg);
    m.finalize().into_bytes().to_vec()
}

/// Checks `proof` against `msg` in constant time.
pub fn verify(key: &[u8], msg: &[u8], proof: &[u8]) -> bool {
    let mut m = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
    m.update(msg);
    m.verify_slice(proof).is_ok()
}

fn transcript(label: &[u8], server_nonce: &[u8], client_nonce: &[u8], identity: &str) -> Vec<u8> {
    let mut t = Vec::with_capacity(label.len() + 2 * NONCE_LEN + identity.len() + 3);
    t.extend_from_slice(label);
    for part in [server_nonce, client_nonce, identity.as_bytes()] {
        t.push(part.len().min(255) as u8);
        t.extend_from_slice(part);
    }
    t
}

/// What the client MACs to prove its key.
pub fn client_transcript(server_nonce: &[u8], client_nonce: &[u8], identity: &str) -> Vec<u8> {
    transcript(b"kiln-auth-v2 client", server_nonce, client_nonce, identity)
}

/// What the server MACs to prove the key back.
pub fn server_transcript(server_nonce: &[u8], client_nonce: &[u8], identity: &str) -> Vec<u8> {
    transcript(b"kiln-auth-v2 server", server_nonce, client_nonce, identity)
}

/// A fresh nonce from the kernel's random source.
pub fn nonce() -> std::io::Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    rustix::rand::getrandom(&mut n, rustix::rand::GetRandomFlags::empty())?;
    Ok(n)
}

/// The client's side of one handshake: the AUTH request it sends, and the check of the proof
/// the server sends back.
pub struct ClientHalf {
    key: Key,
    server_nonce: Vec<u8>,
    client_nonce: [u8; NONCE_LEN],
}

impl ClientHalf {
    /// Answers the server's HELLO nonce with `key`: the AUTH request to send.
    pub fn answer(key: &Key, server_nonce: &[u8]) -> std::io::Result<(ClientHalf, AuthReq)> {
        let client_nonce = nonce()?;
        let req = AuthReq {
            client_nonce: client_nonce.to_vec(),
            proof: mac(
                &key.secret,
                &client_transcript(server_nonce, &client_nonce, &key.identity),
            ),
            identity: key.identity.clone(),
        };
        let half = ClientHalf {
            key: key.clone(),
            server_nonce: server_nonce.to_vec(),
            client_nonce,
        };
        Ok((half, req))
    }

    /// True when the server's AUTH reply proves it holds the same key.
    pub fn server_proved(&self, proof: &[u8]) -> bool {
        verify(
            &self.key.secret,
            &server_transcript(&self.server_nonce, &self.client_nonce, &self.key.identity),
            proof,
        )
    }
}

/// The server's side: true when `req` proves `key` over the nonce the server sent.
pub fn client_proved(key: &[u8], server_nonce: &[u8], req: &AuthReq) -> bool {
    req.client_nonce.len() == NONCE_LEN
        && verify(
            key,
            &client_transcript(server_nonce, &req.client_nonce, &req.identity),
            &req.proof,
        )
}

/// The server's proof back to a client whose `req` it accepted.
pub fn server_proof(key: &[u8], server_nonce: &[u8], req: &AuthReq) -> Vec<u8> {
    mac(
        key,
        &server_transcript(server_nonce, &req.client_nonce, &req.identity),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_sides_agree_and_names_are_bound() {
        let key = Key::parse("t1 0123abcd").unwrap();
        assert_eq!(key.identity, "t1");
        let server_nonce = nonce().unwrap();
        let (half, req) = ClientHalf::answer(&key, &server_nonce).unwrap();
        assert!(client_proved(b"0123abcd", &server_nonce, &req));
        assert!(half.server_proved(&server_proof(b"0123abcd", &server_nonce, &req)));
        // The same key under another name is another identity's proof: refused.
        let other = AuthReq {
            identity: "t2".into(),
            ..req.clone()
        };
        assert!(!client_proved(b"0123abcd", &server_nonce, &other));
        // A wrong key, another nonce: refused.
        assert!(!client_proved(b"0123abce", &server_nonce, &req));
        assert!(!client_proved(b"0123abcd", &nonce().unwrap(), &req));
        // The client's proof is not the server's.
        assert!(!half.server_proved(&req.proof));
    }

    #[test]
    fn key_files_parse_strictly() {
        assert_eq!(Key::parse(" abc\n").unwrap(), Key::shared(b"abc"));
        assert!(Key::parse("").is_err());
        assert!(Key::parse("a b c").is_err());
        assert!(Key::parse("-x abc").is_err());
        assert!(Key::parse("../x abc").is_err());
        assert!(format!("{:?}", Key::parse("t1 s3cr3t").unwrap())
            .find("s3cr3t")
            .is_none());
    }
}
