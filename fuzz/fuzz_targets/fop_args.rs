//! Fuzzes every wire struct's decoder (every fop's request and reply arguments, replication
//! control's marks, stamps): the first byte picks the type from the lists `wire_struct!`
//! makes of what it declares, the rest is its bytes. Decoding never panics, and an accepted
//! value re-encodes to the same bytes. A wire struct added anywhere in those modules is
//! fuzzed without a line here.
#![no_main]

use kiln_proto::{marks, ops, stamp};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let lists = [ops::WIRE_TYPES, marks::WIRE_TYPES, stamp::WIRE_TYPES];
    let total: usize = lists.iter().map(|l| l.len()).sum();
    let mut i = which as usize % total;
    for list in lists {
        if i < list.len() {
            let (_, check) = list[i];
            check(rest);
            return;
        }
        i -= list.len();
    }
});
