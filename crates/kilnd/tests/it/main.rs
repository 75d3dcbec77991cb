//! The kilnd crate's integration tests, one program (one link, not one per file).

mod common;
mod confinement;
mod replica;

mod client_data_path;
mod replicate_busy_host;
mod replicate_checksums;
mod replicate_client_crash;
mod replicate_heal;
mod replicate_heal_entries;
mod replicate_heal_name_race;
mod replicate_local_reads;
mod replicate_missing_file;
mod replicate_overlapping_writes;
mod replicate_partition;
mod replicate_snapshot;
mod server_access;
mod server_auth;
mod server_confinement;
mod server_confinement_race;
mod server_control_fops;
mod server_hostile_frames;
mod server_layers;
mod server_limits;
mod server_open_whole;
mod server_reset_connection;
mod server_slow_storage;
mod server_storage_errors;
mod server_tls;
mod short_circuit;
