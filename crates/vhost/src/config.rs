//! What the device tells the guest: virtio-blk feature bits and the configuration space.

use vhost::vhost_user::message::VhostUserVirtioFeatures;
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// Descriptors per virtqueue at most (the guest picks up to this).
pub const QUEUE_SIZE: usize = 1024;
/// Data segments per request at most: the queue less the header and the status.
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// Bytes per data segment at most.
pub const SIZE_MAX: u32 = 1 << 20;
/// Discard and write-zeroes segments per request at most.
pub const SEGS_MAX: u32 = 32;
/// The sector the protocol counts in.
pub const SECTOR: u64 = 512;
/// Bytes of `struct virtio_blk_config` up to `write_zeroes_may_unmap` (and its padding).
const CONFIG_LEN: usize = 60;

/// The device's virtio feature bits.
pub fn features(read_only: bool) -> u64 {
    let bits = [
        VIRTIO_F_VERSION_1,
        VIRTIO_RING_F_EVENT_IDX,
        VIRTIO_RING_F_INDIRECT_DESC,
        VIRTIO_BLK_F_SIZE_MAX,
        VIRTIO_BLK_F_SEG_MAX,
        VIRTIO_BLK_F_BLK_SIZE,
        VIRTIO_BLK_F_FLUSH,
        VIRTIO_BLK_F_TOPOLOGY,
        VIRTIO_BLK_F_MQ,
        VIRTIO_BLK_F_DISCARD,
        VIRTIO_BLK_F_WRITE_ZEROES,
    ];
    let mut f = bits.iter().fold(0u64, |f, b| f | 1 << b);
    if read_only {
        f |= 1 << VIRTIO_BLK_F_RO;
    }
    f | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
}

/// `struct virtio_blk_config` for an image of `size` bytes served on `queues` queues
/// (little-endian, as the specification lays it out).
pub fn config_space(size: u64, queues: u16) -> Vec<u8> {
    let mut c = vec![0u8; CONFIG_LEN];
    let mut put = |at: usize, v: &[u8]| c[at..at + v.len()].copy_from_slice(v);
    put(0, &(size / SECTOR).to_le_bytes()); // capacity
    put(8, &SIZE_MAX.to_le_bytes()); // size_max
    put(12, &SEG_MAX.to_le_bytes()); // seg_max
    put(20, &(SECTOR as u32).to_le_bytes()); // blk_size
    put(24, &[3]); // physical_block_exp: 4 KiB physical blocks
    put(26, &8u16.to_le_bytes()); // min_io_size, in blk_size units
    put(34, &queues.to_le_bytes()); // num_queues
    put(36, &(u32::MAX >> 9).to_le_bytes()); // max_discard_sectors
    put(40, &SEGS_MAX.to_le_bytes()); // max_discard_seg
    put(44, &8u32.to_le_bytes()); // discard_sector_alignment: 4 KiB
    put(48, &(u32::MAX >> 9).to_le_bytes()); // max_write_zeroes_sectors
    put(52, &SEGS_MAX.to_le_bytes()); // max_write_zeroes_seg
    put(56, &[1]); // write_zeroes_may_unmap
    c
}

/// The slice of the configuration space a `GET_CONFIG` asks for: exactly `size` bytes (zeros
/// past what the device defines), or nothing for a range out of bounds.
pub fn config_slice(space: &[u8], offset: u32, size: u32) -> Vec<u8> {
    let (o, n) = (offset as usize, size as usize);
    if o.checked_add(n).is_none_or(|end| end > 256) {
        return Vec::new();
    }
    (o..o + n)
        .map(|i| space.get(i).copied().unwrap_or(0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_space_is_laid_out_as_the_specification_says() {
        let c = config_space(3 << 30, 4);
        assert_eq!(
            u64::from_le_bytes(c[0..8].try_into().unwrap()),
            (3 << 30) / 512
        );
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), SEG_MAX);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 4);
        assert_eq!(c[56], 1);
        assert_eq!(config_slice(&c, 34, 2), [4, 0]);
        assert_eq!(config_slice(&c, 58, 8), [0; 8]);
        assert!(config_slice(&c, u32::MAX, 8).is_empty());
        assert!(features(true) & (1 << VIRTIO_BLK_F_RO) != 0);
        assert!(features(false) & (1 << VIRTIO_BLK_F_RO) == 0);
    }
}
