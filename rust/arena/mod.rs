//! Storage with no cache policy in it: page ids, intrusive doubly linked lists over slabs, and the
//! hashing of the open-addressing tables.

pub(crate) mod ids;
pub(crate) mod links;
pub(crate) mod table_hash;
