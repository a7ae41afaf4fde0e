//! The TCP groups of every channel: the world ring, and with the 2D
//! allreduce the intra-node and inter-node rings.

use std::net::{IpAddr, SocketAddr};

use super::rendezvous::{RingListener, TOKEN_LEN};
use crate::comm::algo::Layout;
use crate::comm::host::{Groups, Hierarchy};
use crate::comm::transport::Deadline;
use crate::error::{Error, Result};

/// Bound listeners for one rank's groups, before the rings are formed.
pub struct GroupListeners {
    world: RingListener,
    two_d: Option<(Layout, RingListener, RingListener)>,
}

/// Where the other ranks reach this one, per group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupAddresses {
    pub world: String,
    /// Intra-node and inter-node listeners, with the 2D groups.
    pub two_d: Option<(String, String)>,
}

impl GroupListeners {
    /// Listens on `ip` for the world ring, and for the 2D rings when
    /// `layout` is given.
    pub fn bind(ip: IpAddr, layout: Option<Layout>) -> Result<Self> {
        let world = RingListener::bind(ip)?;
        let two_d = match layout {
            None => None,
            Some(l) => Some((l, RingListener::bind(ip)?, RingListener::bind(ip)?)),
        };
        Ok(GroupListeners { world, two_d })
    }

    pub fn addresses(&self) -> GroupAddresses {
        GroupAddresses {
            world: self.world.addr().to_string(),
            two_d: self
                .two_d
                .as_ref()
                .map(|(_, a, e)| (a.addr().to_string(), e.addr().to_string())),
        }
    }

    /// The 2D layout, when the 2D groups are on.
    pub fn layout(&self) -> Option<Layout> {
        self.two_d.as_ref().map(|(l, _, _)| *l)
    }

    /// Forms `channels` sets of rings. `world` holds every rank's world
    /// address; `two_d` the intra-node and inter-node members' addresses (in
    /// [`Layout::intra_members`] and [`Layout::inter_members`] order).
    pub fn connect(
        self,
        rank: usize,
        world: &[SocketAddr],
        two_d: Option<(&[SocketAddr], &[SocketAddr])>,
        token: &[u8; TOKEN_LEN],
        channels: usize,
        deadline: Deadline,
    ) -> Result<Vec<Groups>> {
        let world_rings = self.world.connect(world, rank, token, channels, deadline)?;
        let Some((layout, intra, inter)) = self.two_d else {
            return Ok(world_rings
                .into_iter()
                .map(|r| Groups::flat(Box::new(r)))
                .collect());
        };
        let Some((intra_addrs, inter_addrs)) = two_d else {
            return Err(Error::InvalidArgument(
                "the 2D allreduce is on: its intra-node and inter-node addresses are needed".into(),
            ));
        };
        if intra_addrs.len() != layout.intra_size || inter_addrs.len() != layout.nodes() {
            return Err(Error::InvalidArgument(format!(
                "expected {} intra-node and {} inter-node addresses, got {} and {}",
                layout.intra_size,
                layout.nodes(),
                intra_addrs.len(),
                inter_addrs.len()
            )));
        }
        let intra_rings =
            intra.connect(intra_addrs, layout.local_rank(), token, channels, deadline)?;
        let inter_rings = inter.connect(inter_addrs, layout.node(), token, channels, deadline)?;
        Ok(world_rings
            .into_iter()
            .zip(intra_rings.into_iter().zip(inter_rings))
            .map(|(w, (a, e))| Groups {
                world: Box::new(w),
                hierarchy: Some(Hierarchy {
                    intra: Box::new(a.with_members("intra-node", layout.intra_members())),
                    inter: Box::new(e.with_members("inter-node", layout.inter_members())),
                    layout,
                }),
            })
            .collect())
    }
}
