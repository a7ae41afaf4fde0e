//! The TCP transport: CPU tensors (and CUDA tensors staged through host
//! memory) over plain sockets, one ring of connections per channel.

mod rendezvous;
mod ring;

pub use rendezvous::{local_addr_towards, random_token, RingListener, TOKEN_LEN};
pub use ring::TcpRing;
