//! Storage with no cache policy in it: page ids, intrusive doubly linked lists over slabs, the
//! hashing of the open-addressing tables, and the token compares of the hit paths.

pub(crate) mod compare;
pub(crate) mod ids;
pub(crate) mod links;
pub(crate) mod table_hash;
