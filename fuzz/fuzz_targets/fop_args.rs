//! Fuzzes every fop's argument decoder: the first byte picks the fop, the rest is its argument
//! block. Decoding never panics, and an accepted value re-encodes to the same bytes. The
//! replication control fops and LAYOUT_GET/SET take `(path, argument)` and reply with one value
//! (kiln_layer::for_each_control_fop); they are here with their argument and reply types.
#![no_main]

use kiln_proto::codec::Wire;
use kiln_proto::marks::*;
use kiln_proto::ops::*;
use libfuzzer_sys::fuzz_target;

fn roundtrip<T: Wire + PartialEq + std::fmt::Debug>(bytes: &[u8]) {
    if let Ok(v) = T::from_wire(bytes) {
        assert_eq!(v.to_wire(), bytes, "re-encoding differs");
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 45 {
        0 => roundtrip::<HelloReq>(rest),
        1 => roundtrip::<HelloReply>(rest),
        2 => roundtrip::<PathReq>(rest),
        3 => roundtrip::<HandleReq>(rest),
        4 => roundtrip::<SetattrReq>(rest),
        5 => roundtrip::<FsetattrReq>(rest),
        6 => roundtrip::<OpenReq>(rest),
        7 => roundtrip::<OpenReply>(rest),
        8 => roundtrip::<CreateReq>(rest),
        9 => roundtrip::<CreateReply>(rest),
        10 => roundtrip::<ReadReq>(rest),
        11 => roundtrip::<WriteReq>(rest),
        12 => roundtrip::<WriteReply>(rest),
        13 => roundtrip::<FsyncReq>(rest),
        14 => roundtrip::<MkdirReq>(rest),
        15 => roundtrip::<RenameReq>(rest),
        16 => roundtrip::<ReaddirReq>(rest),
        17 => roundtrip::<ReaddirReply>(rest),
        18 => roundtrip::<SymlinkReq>(rest),
        19 => roundtrip::<ReadlinkReply>(rest),
        20 => roundtrip::<LinkReq>(rest),
        21 => roundtrip::<StatfsReply>(rest),
        22 => roundtrip::<XattrReq>(rest),
        23 => roundtrip::<XattrValue>(rest),
        24 => roundtrip::<SetxattrReq>(rest),
        25 => roundtrip::<XattrNames>(rest),
        26 => roundtrip::<FallocateReq>(rest),
        27 => roundtrip::<DiscardReq>(rest),
        28 => roundtrip::<Attr>(rest),
        29 => roundtrip::<AuthReq>(rest),
        30 => roundtrip::<AuthReply>(rest),
        31 => roundtrip::<(String, Mark)>(rest),
        32 => roundtrip::<(String, CondMark)>(rest),
        33 => roundtrip::<(String, FlagMark)>(rest),
        34 => roundtrip::<(String, CondFlag)>(rest),
        35 => roundtrip::<(String, LockReq)>(rest),
        36 => roundtrip::<(String, HealReq)>(rest),
        37 => roundtrip::<(String, ())>(rest),
        38 => roundtrip::<(String, Vec<u8>)>(rest),
        39 => roundtrip::<PendingPage>(rest),
        40 => roundtrip::<IndexPage>(rest),
        41 => roundtrip::<HealInfo>(rest),
        42 => roundtrip::<MgmtReq>(rest),
        43 => roundtrip::<ProfileReq>(rest),
        _ => roundtrip::<DirEntry>(rest),
    }
});
