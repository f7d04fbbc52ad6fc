//! Formats read outside the crate: the chained block hash (and the namespaces it covers), and the
//! events a cache records for routers.

pub(crate) mod events;
pub(crate) mod hash;
