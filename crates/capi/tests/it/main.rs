//! The capi crate's integration tests, one program (one link, not one per file).

mod common;

mod c_tests;
mod header;
mod read_file;
mod space;
