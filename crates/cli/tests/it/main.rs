//! The cli crate's integration tests, one program (one link, not one per file).

mod common;
/// A pool of hosts in network namespaces (the pool tests').
#[path = "pool_netns/hosts.rs"]
mod hosts;

mod cli_add_brick;
mod cli_brick_restarts;
mod cli_checksums;
mod cli_client_crash;
mod cli_commands;
mod cli_graph_switch;
mod cli_image;
mod cli_json;
mod cli_metrics;
mod cli_mgmt_auth;
mod cli_orphans;
mod cli_pool_netns;
mod cli_pool_partitions;
mod cli_profile;
mod cli_rebalance;
mod cli_rebuild;
mod cli_shard;
mod cli_snapshot;
mod cli_vhost;
mod cli_volume;
mod cli_volume_options;
mod cli_widen;
