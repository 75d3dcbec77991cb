//! Who asks: the credentials a request carries when its header has [`crate::frame::FLAG_CRED`].

use crate::codec::{Dec, DecodeError, Enc, Seq, Wire};

/// Most supplementary groups a credential may carry (Linux's `NGROUPS_MAX`).
pub const MAX_GROUPS: usize = 65536;

/// A caller's identity: user, primary group and supplementary groups.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Cred {
    /// The user id.
    pub uid: u32,
    /// The primary group id (new files get it, unless their directory is setgid).
    pub gid: u32,
    /// Supplementary groups, for access checks.
    pub groups: Vec<u32>,
}

impl Cred {
    /// True for root: the brick's own identity, so nothing needs switching.
    pub fn is_root(&self) -> bool {
        self.uid == 0 && self.gid == 0 && self.groups.is_empty()
    }

    /// Splits a request's arguments into the credentials in front and the fop's own.
    pub fn split(args: &[u8]) -> Result<(Cred, &[u8]), DecodeError> {
        let mut d = Dec::new(args);
        let c = Cred::decode(&mut d)?;
        Ok((c, d.rest()))
    }
}

impl Wire for Cred {
    fn encode(&self, e: &mut Enc) {
        self.uid.encode(e);
        self.gid.encode(e);
        (self.groups.len() as u32).encode(e);
        for g in &self.groups {
            g.encode(e);
        }
    }

    fn decode(d: &mut Dec<'_>) -> Result<Self, DecodeError> {
        let uid = u32::decode(d)?;
        let gid = u32::decode(d)?;
        let Seq(groups) = Seq::<u32>::decode(d)?;
        if groups.len() > MAX_GROUPS {
            return Err(DecodeError::TooLong);
        }
        Ok(Cred { uid, gid, groups })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_prefix_the_arguments() {
        let c = Cred {
            uid: 1000,
            gid: 100,
            groups: vec![4, 24, 27],
        };
        let mut args = c.to_wire();
        args.extend_from_slice(b"rest");
        let (back, rest) = Cred::split(&args).unwrap();
        assert_eq!((back, rest), (c, &b"rest"[..]));
        // A hostile group count cannot make the decoder allocate or read past the block.
        let mut bad = 7u32.to_wire();
        bad.extend(8u32.to_wire());
        bad.extend(u32::MAX.to_wire());
        assert!(Cred::split(&bad).is_err());
        assert!(Cred::split(&[1, 2, 3]).is_err());
    }
}
