//! The replicate layer (being written).

use crate::{Layer, LayerRef};

/// Spreads files over its subvolumes by a hash of the name.
pub struct Replicate {
    name: String,
    kids: Vec<LayerRef>,
}

impl Replicate {
    /// A replicate layer over `kids`.
    pub fn new(name: &str, kids: Vec<LayerRef>, _quorum: Option<u32>) -> Replicate {
        Replicate { name: name.into(), kids }
    }
}

impl Layer for Replicate {
    fn name(&self) -> &str {
        &self.name
    }
    fn children(&self) -> &[LayerRef] {
        &self.kids
    }
}
