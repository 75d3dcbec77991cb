//! The distribute layer (work in progress in this session: see the helper's brief).

use crate::{Layer, LayerRef};

/// Spreads files over its subvolumes by a hash of the name.
pub struct Distribute {
    name: String,
    kids: Vec<LayerRef>,
}

impl Distribute {
    /// A distribute layer over `kids`.
    pub fn new(name: &str, kids: Vec<LayerRef>) -> Distribute {
        Distribute { name: name.into(), kids }
    }
}

impl Layer for Distribute {
    fn name(&self) -> &str {
        &self.name
    }
    fn children(&self) -> &[LayerRef] {
        &self.kids
    }
}
