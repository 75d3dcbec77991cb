//! The nbd crate's integration tests, one program (one link, not one per file).

mod common;

mod nbd_protocol;
mod nbd_tools;
mod nbd_volume;
