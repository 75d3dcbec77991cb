//! Fuzzes the frame header decoder: never panics, and whatever it accepts re-encodes to the
//! same bytes and respects the limits.
#![no_main]

use kiln_proto::frame::{Header, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Header::parse(data) {
        assert!(h.args_len.get() <= kiln_proto::MAX_ARGS_LEN);
        assert!(h.payload_len.get() <= kiln_proto::MAX_PAYLOAD_LEN);
        assert_eq!(&h.to_bytes()[..], &data[..HEADER_LEN]);
    }
});
