//! What an encoded fop request names, read the same way wherever a request is looked at
//! without being run (a brick telling watchers what changed and making grants stale, a client
//! repeating a request after a lost connection): the paths it names, in its own order, and an
//! open's flags. The path fops' part is generated from [`crate::for_each_path_fop`] and the
//! control fops' from [`crate::for_each_control_fop`], so a fop added there is covered here.

use kiln_proto::codec::Wire;
use kiln_proto::ops::{CreateReq, OpenReq, PathReq, ReaddirReq, SetxattrReq, XattrReq};
use kiln_proto::Op;

/// The paths the request `args` of `op` names, for a fop by path; None when they do not
/// decode (the fop itself refuses such arguments) and for fops by connection and most fops by
/// handle (the path-fop list's handle fops give an empty list).
pub fn named_paths(op: Op, args: &[u8]) -> Option<Vec<String>> {
    fn one(path: String) -> Option<Vec<String>> {
        Some(vec![path])
    }
    match op {
        // The fops whose wire form is written by hand (see `for_each_fop`).
        Op::Open | Op::HealOpen => one(OpenReq::from_wire(args).ok()?.path),
        Op::Create => one(CreateReq::from_wire(args).ok()?.path),
        Op::Readdir => one(ReaddirReq::from_wire(args).ok()?.path),
        Op::Setxattr => one(SetxattrReq::from_wire(args).ok()?.path),
        Op::Listxattr => one(PathReq::from_wire(args).ok()?.path),
        Op::Removexattr => one(XattrReq::from_wire(args).ok()?.path),
        _ => path_fop_paths(op, args).or_else(|| control_fop_paths(op, args)),
    }
}

/// The open flags of an open, a heal's open or a create (the fops whose effects depend on
/// `O_TRUNC`); None for any other fop or arguments that do not decode.
pub fn open_flags(op: Op, args: &[u8]) -> Option<u32> {
    match op {
        Op::Open | Op::HealOpen => OpenReq::from_wire(args).ok().map(|r| r.flags),
        Op::Create => CreateReq::from_wire(args).ok().map(|r| r.flags),
        _ => None,
    }
}

/// Makes `path_fop_paths`: each path fop decodes its request struct and keeps the fields
/// whose wire kind is `path`, in order.
macro_rules! path_fop_paths {
    (()
     $( ($name:ident, $o:ident, $req:path { $( $f:ident : $ty:ty => $kind:ident ),* },
         $ret:ty, $wire:ty, $to_ret:tt, $to_wire:tt) )*) => {
        #[allow(clippy::vec_init_then_push)] // one push per path field
        fn path_fop_paths(op: Op, args: &[u8]) -> Option<Vec<String>> {
            match op {
                $( Op::$o => {
                    #[allow(unused_variables)]
                    let r = <$req as Wire>::from_wire(args).ok()?;
                    #[allow(unused_mut)]
                    let mut paths = Vec::new();
                    $( path_fop_paths!(@field paths, r.$f, $kind); )*
                    Some(paths)
                } )*
                _ => None,
            }
        }
    };
    (@field $v:ident, $e:expr, path) => { $v.push($e) };
    (@field $v:ident, $e:expr, $other:ident) => {};
}
crate::for_each_path_fop!(path_fop_paths);

/// Makes `control_fop_paths`: a control fop's request is `(path, argument)`.
macro_rules! control_fop_paths {
    (() $( ($name:ident, $o:ident, $arg:ty, $ret:ty) )*) => {
        fn control_fop_paths(op: Op, args: &[u8]) -> Option<Vec<String>> {
            match op {
                $( Op::$o => <(String, $arg) as Wire>::from_wire(args).ok().map(|(p, _)| vec![p]), )*
                _ => None,
            }
        }
    };
}
crate::for_each_control_fop!(control_fop_paths);

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_proto::ops::*;

    #[test]
    fn paths_come_in_the_request_order_and_only_paths() {
        let link = LinkReq {
            existing: "a".into(),
            path: "b".into(),
        };
        assert_eq!(
            named_paths(Op::Link, &link.to_wire()),
            Some(vec!["a".into(), "b".into()])
        );
        let sym = SymlinkReq {
            target: "elsewhere".into(),
            path: "s".into(),
        };
        assert_eq!(
            named_paths(Op::Symlink, &sym.to_wire()),
            Some(vec!["s".into()])
        );
        let mark = ("f".to_string(), crate::marks::Mark::default());
        assert_eq!(
            named_paths(Op::MarkAdd, &mark.to_wire()),
            Some(vec!["f".into()])
        );
        let fh = HandleReq { fh: 7 };
        assert_eq!(named_paths(Op::Fstat, &fh.to_wire()), Some(vec![]));
        assert_eq!(named_paths(Op::Unlink, b"\xff"), None);
    }

    #[test]
    fn every_fop_that_truncates_on_open_has_open_flags() {
        for &op in Op::ALL {
            if op.effects().any(Effects::TRUNC) {
                let args = match op {
                    Op::Create => CreateReq::default().to_wire(),
                    _ => OpenReq::default().to_wire(),
                };
                assert!(open_flags(op, &args).is_some(), "{op:?}");
            }
        }
    }
}
