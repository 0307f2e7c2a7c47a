//! The upstream side: what reaches a node on the wire, and how nodes are chosen.

mod balance;
mod streamed;
mod wire;
