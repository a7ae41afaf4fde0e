//! The groups of every channel: the world ring, and with the 2D allreduce
//! the intra-node and inter-node rings, formed over TCP and moved to shared
//! memory where they can be. Above both `tcp/` and `shm/` (it uses both,
//! neither uses it).

use std::net::{IpAddr, SocketAddr};

use super::algo::Layout;
use super::host::{Groups, Hierarchy};
use super::shm;
use super::tcp::{RingListener, TcpRing, TOKEN_LEN};
use super::transport::{Deadline, Transport};
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
    ///
    /// With `shared_memory`, the world group (when the whole job is on this
    /// host) and the intra-node group move their data through shared memory
    /// instead of their TCP ring ([`shm::attach`]); the inter-node group
    /// always uses TCP.
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        self,
        rank: usize,
        world: &[SocketAddr],
        two_d: Option<(&[SocketAddr], &[SocketAddr])>,
        token: &[u8; TOKEN_LEN],
        channels: usize,
        shared_memory: bool,
        deadline: Deadline,
    ) -> Result<Vec<Groups>> {
        let world_rings = self.world.connect(world, rank, token, channels, deadline)?;
        let world_groups = over_shared_memory(world_rings, shared_memory, deadline)?;
        let Some((layout, intra, inter)) = self.two_d else {
            return Ok(world_groups.into_iter().map(Groups::flat).collect());
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
        let intra_rings = intra
            .connect(intra_addrs, layout.local_rank(), token, channels, deadline)?
            .into_iter()
            .map(|a| a.with_members("intra-node", layout.intra_members()))
            .collect();
        let intra_groups = over_shared_memory(intra_rings, shared_memory, deadline)?;
        let inter_rings = inter.connect(inter_addrs, layout.node(), token, channels, deadline)?;
        Ok(world_groups
            .into_iter()
            .zip(intra_groups.into_iter().zip(inter_rings))
            .map(|(world, (intra, e))| Groups {
                world,
                hierarchy: Some(Hierarchy {
                    intra,
                    inter: Box::new(e.with_members("inter-node", layout.inter_members())),
                    layout,
                }),
            })
            .collect())
    }
}

/// Each channel's ring, moved to shared memory where [`shm::attach`] can
/// (channel by channel, in the same order on every member). A failure to
/// set it up where it should work is reported once, by the group's first
/// member, and the ring is kept.
fn over_shared_memory(
    rings: Vec<TcpRing>,
    shared_memory: bool,
    deadline: Deadline,
) -> Result<Vec<Box<dyn Transport>>> {
    let mut out: Vec<Box<dyn Transport>> = Vec::with_capacity(rings.len());
    for ring in rings {
        if !shared_memory {
            out.push(Box::new(ring));
            continue;
        }
        let (first, group, channel) = (ring.rank() == 0, ring.group(), ring.channel());
        let mut why = None;
        let transport = shm::attach(ring, deadline, &mut why)?;
        if let (true, Some(why)) = (first, why) {
            if why != shm::NOT_ONE_HOST && channel == 0 {
                eprintln!(
                    "tiacc_training: the {group} group keeps TCP instead of shared memory: {why}"
                );
            }
        }
        out.push(transport);
    }
    Ok(out)
}
