//! The shared-secret handshake: what each side MACs (HMAC-SHA256 keyed with the secret).
//!
//! 1. HELLO: the server answers with `auth_required` and a fresh 32-byte nonce.
//! 2. AUTH: the client sends its own fresh nonce and `HMAC(secret, client transcript)`.
//! 3. The server checks it (constant time) and answers `HMAC(secret, server transcript)`, which
//!    the client checks in turn: both sides prove the secret, and it never crosses the wire.
//!
//! The two transcripts differ in their label, so one side's proof is never valid for the other,
//! and both nonces are in each, so a recorded exchange does not replay.

/// Length of each side's nonce.
pub const NONCE_LEN: usize = 32;

fn transcript(label: &[u8], server_nonce: &[u8], client_nonce: &[u8]) -> Vec<u8> {
    let mut t = Vec::with_capacity(label.len() + 2 * NONCE_LEN + 2);
    t.extend_from_slice(label);
    t.push(server_nonce.len() as u8);
    t.extend_from_slice(server_nonce);
    t.push(client_nonce.len() as u8);
    t.extend_from_slice(client_nonce);
    t
}

/// What the client MACs to prove the secret.
pub fn client_transcript(server_nonce: &[u8], client_nonce: &[u8]) -> Vec<u8> {
    transcript(b"kiln-auth-v1 client", server_nonce, client_nonce)
}

/// What the server MACs to prove the secret back.
pub fn server_transcript(server_nonce: &[u8], client_nonce: &[u8]) -> Vec<u8> {
    transcript(b"kiln-auth-v1 server", server_nonce, client_nonce)
}
