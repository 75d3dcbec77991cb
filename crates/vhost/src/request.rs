//! One virtio-blk request, read from its descriptor chain: the header, the guest memory of its
//! data as host vectors, and where its status byte goes.
//!
//! The guest's data buffers are not copied anywhere: their host addresses (guest RAM is
//! mapped into this process, shared by QEMU) become the vectors of the Kiln read or write,
//! so a read's payload lands from the brick's socket straight in the guest's pages.

use std::sync::Arc;

use kiln_client::RawIov;
use virtio_bindings::virtio_blk::*;
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// Guest memory, kept mapped while a request uses it.
pub type Mem = Arc<GuestMemoryMmap>;

/// What a request asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Read into the data buffers.
    Read,
    /// Write the data buffers.
    Write,
    /// Make what was written durable.
    Flush,
    /// The device's serial number (20 bytes).
    GetId,
    /// Forget the segments' ranges (the data buffers hold the segments).
    Discard,
    /// Make the segments' ranges read as zeros.
    WriteZeroes,
    /// Anything else: answered `VIRTIO_BLK_S_UNSUPP`.
    Unsupported(u32),
}

/// A request, parsed.
#[derive(Debug)]
pub struct Request {
    /// The chain's head: what the used ring names.
    pub head: u16,
    /// What it asks.
    pub kind: Kind,
    /// Where, in 512-byte sectors.
    pub sector: u64,
    /// The data buffers, in order: (guest address, length).
    pub data: Vec<(GuestAddress, u32)>,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

/// Why a chain is not a request (the driver broke the protocol).
#[derive(Debug)]
pub struct Malformed(pub &'static str);

impl Request {
    /// Parses the chain whose descriptors are `descs` (head `head`) in `mem`.
    pub fn parse(
        head: u16,
        descs: &[Descriptor],
        mem: &GuestMemoryMmap,
    ) -> Result<Request, Malformed> {
        let (first, rest) = descs.split_first().ok_or(Malformed("an empty chain"))?;
        if first.is_write_only() || first.len() < 16 {
            return Err(Malformed("the header is not 16 readable bytes"));
        }
        let hdr: [u8; 16] = mem
            .read_obj(first.addr())
            .map_err(|_| Malformed("the header is outside guest memory"))?;
        let kind = match u32::from_le_bytes(hdr[0..4].try_into().expect("4 bytes")) {
            VIRTIO_BLK_T_IN => Kind::Read,
            VIRTIO_BLK_T_OUT => Kind::Write,
            VIRTIO_BLK_T_FLUSH => Kind::Flush,
            VIRTIO_BLK_T_GET_ID => Kind::GetId,
            VIRTIO_BLK_T_DISCARD => Kind::Discard,
            VIRTIO_BLK_T_WRITE_ZEROES => Kind::WriteZeroes,
            t => Kind::Unsupported(t),
        };
        let sector = u64::from_le_bytes(hdr[8..16].try_into().expect("8 bytes"));
        let mut data = Vec::with_capacity(rest.len());
        if first.len() > 16 {
            data.push((first.addr().unchecked_add(16), first.len() - 16));
        }
        data.extend(rest.iter().map(|d| (d.addr(), d.len())));
        // The status is the last byte of the last descriptor, which the device writes.
        let last = descs.last().expect("not empty");
        if !last.is_write_only() || last.len() == 0 || (descs.len() == 1) {
            return Err(Malformed("no writable status byte"));
        }
        let (addr, len) = data.pop().expect("the last descriptor is data");
        let status = addr.unchecked_add(u64::from(len) - 1);
        if len > 1 {
            data.push((addr, len - 1));
        }
        // Each data buffer goes one way: written by the device for a read, read otherwise.
        let device_writes = matches!(kind, Kind::Read | Kind::GetId);
        let middle = &rest[..rest.len() - 1];
        let wrong = middle.iter().any(|d| d.is_write_only() != device_writes)
            || (first.len() > 16 && device_writes)
            || (last.len() > 1 && !device_writes);
        if wrong && !matches!(kind, Kind::Unsupported(_)) {
            return Err(Malformed("a data buffer goes the wrong way"));
        }
        Ok(Request {
            head,
            kind,
            sector,
            data,
            status,
        })
    }

    /// Bytes of data.
    pub fn len(&self) -> u64 {
        self.data.iter().map(|(_, l)| u64::from(*l)).sum()
    }

    /// No data at all.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The data buffers as host vectors (a buffer that spans two memory regions gives two).
    pub fn vectors(&self, mem: &GuestMemoryMmap) -> Result<Vec<RawIov>, Malformed> {
        let mut out = Vec::with_capacity(self.data.len());
        for (addr, len) in &self.data {
            for s in GuestMemoryBackend::get_slices(mem, *addr, *len as usize) {
                let s = s.map_err(|_| Malformed("a data buffer is outside guest memory"))?;
                let g = s.ptr_guard_mut();
                out.push(RawIov {
                    base: g.as_ptr() as usize,
                    len: g.len(),
                });
            }
        }
        Ok(out)
    }

    /// The discard or write-zeroes segments: (sector, sectors, flags).
    pub fn segments(&self, mem: &GuestMemoryMmap) -> Result<Vec<(u64, u32, u32)>, Malformed> {
        let mut out = Vec::new();
        for (addr, len) in &self.data {
            if len % 16 != 0 {
                return Err(Malformed("a segment buffer is not whole segments"));
            }
            for i in 0..u64::from(len / 16) {
                let seg: [u8; 16] = mem
                    .read_obj(addr.unchecked_add(i * 16))
                    .map_err(|_| Malformed("a segment is outside guest memory"))?;
                out.push((
                    u64::from_le_bytes(seg[0..8].try_into().expect("8 bytes")),
                    u32::from_le_bytes(seg[8..12].try_into().expect("4 bytes")),
                    u32::from_le_bytes(seg[12..16].try_into().expect("4 bytes")),
                ));
            }
        }
        Ok(out)
    }
}
