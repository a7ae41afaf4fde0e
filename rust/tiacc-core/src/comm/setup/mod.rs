//! Setting an engine up, apart from any framework: what every engine is
//! built from ([`EngineSetup`]: this rank's place in the job, the
//! configuration, the 2D layout and the algorithm settings), the TCP
//! listeners before the rings form ([`TcpSetup`]), and the two engines a
//! training process runs, from the moment they listen to their shutdown:
//! [`CommEngine`] (CPU buckets on the channel threads of an [`Engine`]) and
//! [`DeviceEngine`] (buckets in a framework's buffers through
//! [`DeviceChannels`], over NCCL or TCP). The 2D layout is agreed through
//! the rendezvous first ([`layout`]).
//!
//! The engine's algorithm is adopted here: flat, or 2D when the 2D groups
//! are connected (the layout agreed in [`layout`]); under
//! `TIACC_TRAINING_ALGORITHM=auto` the probe ([`auto`]) then times both
//! once the groups are up, and its verdict is what every channel runs. Every call that waits on peers blocks: a
//! framework releases its own lock around them (the device engine's calls
//! do so through [`Kernels::unlocked`]).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use super::algo::{AlgoSettings, Layout};
use super::auto::{self, Probe};
use super::counters::Counters;
use super::device::{Comms, DeviceChannels, Kernels, NcclIds};
use super::engine::Engine;
use super::failure::FailureBoard;
use super::groups::GroupListeners;
use super::host::Groups;
use super::nccl::{NcclLibrary, NcclUniqueId};
use super::store::{Rendezvous, TcpExchange, TcpPeers};
use super::tcp::TOKEN_LEN;
use super::transport::Deadline;
use crate::config::{self, AlgorithmChoice, CommConfig};
use crate::error::{Error, Result};

mod layout;

pub use layout::{host_name, Placement, Scope, TwoD};

/// What every engine is built from: this rank's place in the job, the
/// configuration, and the algorithm settings derived from them.
#[derive(Debug, Clone)]
pub struct EngineSetup {
    rank: usize,
    size: usize,
    timeout: Duration,
    num_channels: usize,
    config: CommConfig,
    settings: AlgoSettings,
    /// The 2D layout, when the 2D groups connect.
    layout: Option<Layout>,
    /// Whether the job spans nodes (unknown counts as yes).
    spans_nodes: bool,
    /// Ranks per node, when the launcher said.
    local_size: Option<usize>,
    /// What `TIACC_TRAINING_ALGORITHM=auto` measured and chose, once it ran.
    auto_choice: Option<String>,
    /// Why a group runs flat where its configuration asked for 2D.
    layout_note: Option<String>,
}

impl EngineSetup {
    /// Checks the rank, agrees the 2D layout through `rendezvous` under
    /// `scope` ([`Rendezvous::two_d_layout`]; without one, no 2D groups)
    /// and derives the settings (`placement`: where the launcher put this
    /// rank).
    pub fn new(
        config: &CommConfig,
        rank: usize,
        size: usize,
        placement: Placement,
        rendezvous: Option<(&Rendezvous<'_>, Scope)>,
    ) -> Result<Self> {
        check_rank(rank, size)?;
        let two_d = match rendezvous {
            Some((rendezvous, scope)) => rendezvous.two_d_layout(config, size, placement, scope)?,
            None => TwoD::default(),
        };
        let mut setup = Self::with_layout(config, rank, size, placement.local_size, two_d.layout)?;
        setup.layout_note = two_d.note;
        Ok(setup)
    }

    /// [`EngineSetup::new`] with `layout` as agreed already (`local_size`
    /// is the launcher's ranks per node).
    pub(crate) fn with_layout(
        config: &CommConfig,
        rank: usize,
        size: usize,
        local_size: Option<usize>,
        layout: Option<Layout>,
    ) -> Result<Self> {
        check_rank(rank, size)?;
        Ok(EngineSetup {
            rank,
            size,
            timeout: config.timeout,
            num_channels: config.num_streams,
            settings: AlgoSettings::from_config(config, size, local_size, layout.is_some()),
            layout,
            spans_nodes: config::spans_nodes(size, local_size),
            local_size,
            auto_choice: None,
            layout_note: None,
            config: config.clone(),
        })
    }

    /// The same with `channels` channels instead of the configuration's
    /// (the torch.distributed backend runs its collectives in order on one).
    pub fn with_channels(mut self, channels: usize) -> Result<Self> {
        if channels == 0 {
            return Err(Error::InvalidArgument("channels must be at least 1".into()));
        }
        self.num_channels = channels;
        Ok(self)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The per-collective timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn num_channels(&self) -> usize {
        self.num_channels
    }

    /// The configuration the engine was built from.
    pub fn config(&self) -> &CommConfig {
        &self.config
    }

    /// The settings every channel runs (as `auto` chose, once it ran).
    pub fn settings(&self) -> &AlgoSettings {
        &self.settings
    }

    /// Whether buckets take the 2D allreduce (up to the hierarchical
    /// threshold), as forced or as `auto` chose.
    pub fn two_d(&self) -> bool {
        self.settings.hierarchical_threshold.is_some()
    }

    /// The 2D layout, when the 2D groups are on.
    pub fn layout(&self) -> Option<Layout> {
        self.layout
    }

    /// The line explaining what `TIACC_TRAINING_ALGORITHM=auto` measured
    /// and chose, once it ran.
    pub fn auto_choice(&self) -> Option<&str> {
        self.auto_choice.as_deref()
    }

    /// The line rank 0 logs when a group of the "tiacc" backend runs flat
    /// because its ranks do not form whole nodes ([`Scope::Group`]).
    pub fn layout_note(&self) -> Option<&str> {
        self.layout_note.as_deref()
    }

    /// World ranks of this rank's node and of its inter-node group, with
    /// the 2D groups.
    pub fn two_d_members(&self) -> Option<(Vec<usize>, Vec<usize>)> {
        self.layout.map(|l| (l.intra_members(), l.inter_members()))
    }

    /// The probe `TIACC_TRAINING_ALGORITHM=auto` runs once the 2D groups
    /// are connected (its length in bytes), or `None` when nothing is to be
    /// measured (2D or flat forced, or no 2D groups).
    pub fn auto_probe_bytes(&self) -> Option<usize> {
        (self.config.algorithm == AlgorithmChoice::Auto && self.layout.is_some()).then(|| {
            auto::probe_bytes(self.config.fusion_threshold.min(usize::MAX as u64) as usize)
        })
    }

    /// Takes `auto`'s choice from `probe`: the settings every channel is
    /// then built with, and the line that explains it (`turns`: the
    /// channels take turns on the link between nodes). Returns whether 2D
    /// was chosen.
    fn adopt(&mut self, probe: &Probe, turns: bool) -> bool {
        let decision = probe.decide(self.num_channels, turns);
        self.settings =
            AlgoSettings::from_config(&self.config, self.size, self.local_size, decision.two_d);
        self.auto_choice = Some(decision.line);
        decision.two_d
    }
}

/// Listeners for a rank's TCP groups, before `connect`.
pub struct TcpSetup {
    rank: usize,
    size: usize,
    listeners: Option<GroupListeners>,
}

impl TcpSetup {
    /// Listens on `host` (an IP address) for the world ring, and for the 2D
    /// rings with `layout`.
    pub fn bind(rank: usize, size: usize, host: &str, layout: Option<Layout>) -> Result<Self> {
        let ip: IpAddr = host.parse().map_err(|_| {
            Error::InvalidArgument(format!("host must be an IP address, got {host:?}"))
        })?;
        Ok(TcpSetup {
            rank,
            size,
            listeners: Some(GroupListeners::bind(ip, layout)?),
        })
    }

    /// Stops listening (connections not yet formed are refused).
    pub fn close(&mut self) {
        self.listeners = None;
    }

    /// `ip:port` of the world listener, before connecting.
    pub fn address(&self) -> Option<String> {
        self.listeners.as_ref().map(|l| l.addresses().world)
    }

    /// `ip:port` of the intra-node and inter-node listeners, with the 2D
    /// groups, before connecting.
    pub fn two_d_addresses(&self) -> Option<(String, String)> {
        self.listeners.as_ref().and_then(|l| l.addresses().two_d)
    }

    /// Publishes this rank's listeners through `rendezvous` and collects
    /// every peer's (for the 2D groups `setup` connects), before
    /// [`TcpSetup::connect`].
    pub fn exchange(
        &self,
        rendezvous: &Rendezvous<'_>,
        setup: &EngineSetup,
    ) -> Result<TcpExchange> {
        let address = self.address().ok_or_else(already_connected)?;
        let two_d = self.two_d_addresses();
        let members = setup.two_d_members();
        rendezvous.tcp_peers(
            self.size,
            &address,
            two_d.as_ref().map(|(a, e)| (a.as_str(), e.as_str())),
            members.as_ref().map(|(a, e)| (a.as_slice(), e.as_slice())),
        )
    }

    /// Forms the rings of `channels` channels with `peers`; blocks until
    /// every connection is up or `timeout` passes. Only once.
    pub fn connect(
        &mut self,
        peers: &TcpPeers<'_>,
        channels: usize,
        shared_memory: bool,
        timeout: Duration,
    ) -> Result<Vec<Groups>> {
        if peers.addresses.len() != self.size {
            return Err(Error::InvalidArgument(format!(
                "expected {} addresses (one per rank), got {}",
                self.size,
                peers.addresses.len()
            )));
        }
        let token: [u8; TOKEN_LEN] = peers.token.try_into().map_err(|_| {
            Error::InvalidArgument(format!(
                "the job token must be {TOKEN_LEN} bytes, got {}",
                peers.token.len()
            ))
        })?;
        let world = parse_addresses(peers.addresses)?;
        let two_d = match (peers.intra_addresses, peers.inter_addresses) {
            (Some(a), Some(e)) => Some((parse_addresses(a)?, parse_addresses(e)?)),
            _ => None,
        };
        let listeners = self.listeners.take().ok_or_else(already_connected)?;
        let two_d = two_d.as_ref().map(|(a, e)| (a.as_slice(), e.as_slice()));
        listeners.connect(
            self.rank,
            &world,
            two_d,
            &token,
            channels,
            shared_memory,
            Deadline::after(timeout),
        )
    }
}

fn check_rank(rank: usize, size: usize) -> Result<()> {
    if size == 0 || rank >= size {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} is not a rank of a group of {size}"
        )));
    }
    Ok(())
}

fn already_connected() -> Error {
    Error::InvalidArgument("connect() was already called on this engine".into())
}

fn parse_addresses(addresses: &[String]) -> Result<Vec<SocketAddr>> {
    addresses
        .iter()
        .enumerate()
        .map(|(i, a)| {
            a.parse::<SocketAddr>()
                .map_err(|_| Error::InvalidArgument(format!("address #{i} {a:?} is not ip:port")))
        })
        .collect()
}

/// The CPU engine of one process: listening from the start ([`TcpSetup`]),
/// then, once connected, the channel threads of an [`Engine`] running the
/// settings [`EngineSetup`] decided.
pub struct CommEngine {
    setup: EngineSetup,
    tcp: TcpSetup,
    board: Option<Arc<dyn FailureBoard>>,
    engine: Option<Engine>,
    /// What carries each group's bytes on the first channel, once connected.
    media: Vec<(&'static str, &'static str)>,
    /// The engine's counters, kept past `shutdown` (for the summary at exit).
    counters: Option<Arc<Counters>>,
}

impl CommEngine {
    /// Listens on `host` for the groups `setup` asks for; `board` is the
    /// job's failure board.
    pub fn new(
        setup: EngineSetup,
        host: &str,
        board: Option<Arc<dyn FailureBoard>>,
    ) -> Result<Self> {
        Ok(CommEngine {
            tcp: TcpSetup::bind(setup.rank, setup.size, host, setup.layout)?,
            setup,
            board,
            engine: None,
            media: Vec::new(),
            counters: None,
        })
    }

    pub fn setup(&self) -> &EngineSetup {
        &self.setup
    }

    pub fn tcp(&self) -> &TcpSetup {
        &self.tcp
    }

    /// Whether `connect` has completed and `shutdown` has not run.
    pub fn connected(&self) -> bool {
        self.engine.is_some()
    }

    /// What carries each group's bytes on the first channel
    /// ([`Groups::media`]), once connected.
    pub fn media(&self) -> &[(&'static str, &'static str)] {
        &self.media
    }

    /// What the engine carried so far; `None` before `connect`, kept after
    /// `shutdown`.
    pub fn counters(&self) -> Option<&Counters> {
        self.counters.as_deref()
    }

    /// Forms the rings with `peers`; under `auto` with the 2D groups, times
    /// flat against 2D on the first channel's groups and keeps what its rounds decide;
    /// then starts the channel threads. Blocks until every connection is up
    /// (or the timeout passes) and the probe is done.
    pub fn connect(&mut self, peers: &TcpPeers<'_>) -> Result<()> {
        let setup = &self.setup;
        let mut groups = self.tcp.connect(
            peers,
            setup.num_channels,
            setup.config.shared_memory,
            setup.timeout,
        )?;
        if let Some(bytes) = setup.auto_probe_bytes().filter(|_| !groups.is_empty()) {
            let first = groups.remove(0);
            let (first, probe) = auto::measure(first, bytes, Deadline::after(setup.timeout));
            groups.insert(0, first);
            let turns = setup.spans_nodes;
            self.setup.adopt(&probe?, turns);
        }
        self.media = groups.first().map(Groups::media).unwrap_or_default();
        let settings = self.setup.settings;
        let spec = groups.into_iter().map(|g| (g, settings)).collect();
        let engine = Engine::with_channels(
            spec,
            self.setup.timeout,
            self.board.clone(),
            self.setup.spans_nodes,
        )?;
        self.counters = Some(Arc::clone(engine.counters()));
        self.engine = Some(engine);
        Ok(())
    }

    /// Exchanges the addresses and the job token through `rendezvous`, then
    /// [`CommEngine::connect`]s.
    pub fn connect_through(&mut self, rendezvous: &Rendezvous<'_>) -> Result<()> {
        let exchange = self.tcp.exchange(rendezvous, &self.setup)?;
        self.connect(&exchange.peers())
    }

    /// The running engine, or a [`Error::Comm`] before `connect` and after
    /// `shutdown`.
    pub fn engine(&self) -> Result<&Engine> {
        self.engine.as_ref().ok_or_else(|| Error::Comm {
            peer: None,
            message: format!(
                "rank {}: the communication engine is not connected (call connect() first) or was shut down",
                self.setup.rank
            ),
        })
    }

    /// Stops listening, finishes queued collectives and stops the channel
    /// threads (blocks until they end). Safe to call twice.
    pub fn shutdown(&mut self) {
        self.tcp.close();
        if let Some(mut engine) = self.engine.take() {
            engine.shutdown();
        }
    }
}

/// How a [`DeviceEngine`]'s channels reach the other ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceTransport {
    /// NCCL communicators (device buffers).
    Nccl,
    /// TCP rings listening on `host` (host buffers).
    Tcp { host: String },
}

impl DeviceTransport {
    /// `transport` as a caller names it (`nccl` or `tcp`); `tcp` needs
    /// `host`.
    pub fn parse(transport: &str, host: Option<&str>) -> Result<Self> {
        match (transport, host) {
            ("nccl", _) => Ok(DeviceTransport::Nccl),
            ("tcp", Some(host)) => Ok(DeviceTransport::Tcp {
                host: host.to_string(),
            }),
            ("tcp", None) => Err(Error::InvalidArgument(
                "transport 'tcp' needs the host address to listen on".into(),
            )),
            (other, _) => Err(Error::InvalidArgument(format!(
                "transport must be 'nccl' or 'tcp', got {other:?}"
            ))),
        }
    }

    /// [`parse`](Self::parse) for tensors on `device` (torch's device type:
    /// `cpu`, `cuda`, ...): TCP collectives read and write the tensors'
    /// memory from the host, so `tcp` takes only CPU tensors.
    pub fn parse_for(transport: &str, host: Option<&str>, device: &str) -> Result<Self> {
        let parsed = Self::parse(transport, host)?;
        if let DeviceTransport::Tcp { .. } = parsed {
            if device != "cpu" {
                return Err(Error::InvalidArgument(format!(
                    "transport 'tcp' runs on CPU tensors, but the kernels are on {device}; \
                     CUDA tensors go over TCP through host staging"
                )));
            }
        }
        Ok(parsed)
    }
}

/// The NCCL unique ids a rank joins with, as the rendezvous handed them
/// over: per channel, the world's, and with the 2D groups the intra-node
/// and inter-node ones.
#[derive(Debug, Clone, Copy)]
pub struct NcclIdBytes<'a> {
    pub world: &'a [Vec<u8>],
    pub intra: Option<&'a [Vec<u8>]>,
    pub inter: Option<&'a [Vec<u8>]>,
}

/// The device engine of one process: [`DeviceChannels`] over buffers of
/// type `B`, from the moment it exists (listening already with TCP) to
/// its shutdown.
pub struct DeviceEngine<B> {
    setup: EngineSetup,
    /// The listeners, with transport `tcp`; `None` with NCCL.
    tcp: Option<TcpSetup>,
    channels: DeviceChannels<B>,
}

impl<B> DeviceEngine<B> {
    /// An engine of the channels `setup` describes over `transport`;
    /// `board` is the job's failure board.
    pub fn new(
        setup: EngineSetup,
        transport: DeviceTransport,
        board: Option<Arc<dyn FailureBoard>>,
    ) -> Result<Self> {
        let tcp = match transport {
            DeviceTransport::Nccl => None,
            DeviceTransport::Tcp { host } => {
                Some(TcpSetup::bind(setup.rank, setup.size, &host, setup.layout)?)
            }
        };
        let channels = DeviceChannels::new(setup.rank, setup.size, setup.timeout, board)?;
        Ok(DeviceEngine {
            setup,
            tcp,
            channels,
        })
    }

    pub fn setup(&self) -> &EngineSetup {
        &self.setup
    }

    /// The listeners, with transport `tcp`.
    pub fn tcp(&self) -> Option<&TcpSetup> {
        self.tcp.as_ref()
    }

    /// `nccl` or `tcp`.
    pub fn transport(&self) -> &'static str {
        match self.tcp {
            None => "nccl",
            Some(_) => "tcp",
        }
    }

    /// The channels (buckets, collectives, state, failures).
    pub fn channels(&self) -> &DeviceChannels<B> {
        &self.channels
    }

    /// Whether opening the channels first runs `auto`'s probe; the
    /// `connect_*` calls then need the stream the caller runs on.
    pub fn probes(&self) -> bool {
        self.setup.auto_probe_bytes().is_some()
    }

    /// Forms the TCP rings with `peers` (blocks, with the framework's lock
    /// released, until every connection is up), then opens the channels.
    /// `stream` is the stream the caller runs on, needed where
    /// [`DeviceEngine::probes`].
    pub fn connect_tcp<K: Kernels<Buffer = B>>(
        &mut self,
        kernels: &K,
        peers: &TcpPeers<'_>,
        stream: Option<usize>,
    ) -> Result<()> {
        let Some(tcp) = self.tcp.as_mut().filter(|_| !self.channels.opened()) else {
            return Err(not_tcp());
        };
        if self.setup.auto_probe_bytes().is_some() && stream.is_none() {
            return Err(no_stream());
        }
        let setup = &self.setup;
        let (channels, shared_memory, timeout) = (
            setup.num_channels,
            setup.config.shared_memory,
            setup.timeout,
        );
        let groups = kernels.unlocked(|| tcp.connect(peers, channels, shared_memory, timeout))?;
        self.channels.watch_tcp(&groups);
        let comms = groups.into_iter().map(Comms::Tcp).collect();
        self.open(kernels, comms, stream)
    }

    /// Connects over the engine's transport with what the ranks exchange
    /// through `rendezvous`, then opens the channels (see
    /// [`DeviceEngine::connect_tcp`] for `stream`). With TCP,
    /// [`DeviceEngine::connect_tcp_through`]. With NCCL, joins the
    /// communicators, per channel the world's and with the 2D groups the
    /// node's and the inter-node group's, from unique ids each group's first
    /// member makes with the library `library` loads, on the calling
    /// thread's CUDA device (blocks, with the framework's lock released,
    /// until every member joined).
    pub fn connect_through<K: Kernels<Buffer = B>>(
        &mut self,
        kernels: &K,
        rendezvous: &Rendezvous<'_>,
        library: impl FnOnce() -> Result<Arc<NcclLibrary>> + Send,
        stream: Option<usize>,
    ) -> Result<()>
    where
        B: Send,
    {
        if self.tcp.is_some() {
            return self.connect_tcp_through(kernels, rendezvous, stream);
        }
        if self.channels.opened() {
            return Err(not_nccl());
        }
        self.check_stream(stream)?;
        let library = kernels.unlocked(library)?;
        let members = self.setup.two_d_members();
        let mut new_id = || Ok(library.unique_id()?.to_bytes().to_vec());
        let (world, two_d) = rendezvous.nccl_ids(
            self.setup.num_channels,
            members.as_ref().map(|(a, e)| (a.as_slice(), e.as_slice())),
            &mut new_id,
        )?;
        let ids = NcclIdBytes {
            world: &world,
            intra: two_d.as_ref().map(|(a, _)| a.as_slice()),
            inter: two_d.as_ref().map(|(_, e)| e.as_slice()),
        };
        let ids = self.nccl_ids(&ids)?;
        let channels = &self.channels;
        let groups = kernels.unlocked(|| channels.join_nccl(library, &ids))?;
        self.channels.watch_nccl(&groups)?;
        let comms = groups.into_iter().map(Comms::Nccl).collect();
        self.open(kernels, comms, stream)
    }

    /// [`DeviceEngine::connect_tcp`] with the peers exchanged through
    /// `rendezvous`.
    pub fn connect_tcp_through<K: Kernels<Buffer = B>>(
        &mut self,
        kernels: &K,
        rendezvous: &Rendezvous<'_>,
        stream: Option<usize>,
    ) -> Result<()> {
        let Some(tcp) = self.tcp.as_ref().filter(|_| !self.channels.opened()) else {
            return Err(not_tcp());
        };
        self.check_stream(stream)?;
        let exchange = tcp.exchange(rendezvous, &self.setup)?;
        self.connect_tcp(kernels, &exchange.peers(), stream)
    }

    /// Stops the watchdog, aborts the communicators (never waits on peers)
    /// and stops listening. Safe to call twice.
    pub fn shutdown<K: Kernels>(&mut self, kernels: &K) {
        self.channels.shutdown(kernels);
        if let Some(tcp) = self.tcp.as_mut() {
            tcp.close();
        }
    }

    /// [`DeviceEngine::probes`] without a `stream` is refused before
    /// anything connects.
    fn check_stream(&self, stream: Option<usize>) -> Result<()> {
        match (self.probes(), stream) {
            (true, None) => Err(no_stream()),
            _ => Ok(()),
        }
    }

    /// `ids` checked (one of each per channel; the 2D ones exactly when
    /// the 2D groups are on) and converted.
    fn nccl_ids(&self, ids: &NcclIdBytes<'_>) -> Result<NcclIds> {
        let channels = self.setup.num_channels;
        let convert = |list: &[Vec<u8>], what: &str| -> Result<Vec<NcclUniqueId>> {
            if list.len() != channels {
                return Err(Error::InvalidArgument(format!(
                    "expected {channels} {what} NCCL ids (one per channel), got {}",
                    list.len()
                )));
            }
            list.iter().map(|b| NcclUniqueId::from_slice(b)).collect()
        };
        let two_d =
            match (self.setup.layout, ids.intra, ids.inter) {
                (None, _, _) => None,
                (Some(layout), Some(a), Some(e)) => {
                    Some((layout, convert(a, "intra")?, convert(e, "inter")?))
                }
                (Some(_), _, _) => return Err(Error::InvalidArgument(
                    "the 2D allreduce is on: the intra-node and inter-node NCCL ids are missing"
                        .into(),
                )),
            };
        Ok(NcclIds {
            world: convert(ids.world, "world")?,
            two_d,
        })
    }

    /// Opens the channels over `comms`. Under `TIACC_TRAINING_ALGORITHM=auto`
    /// with the 2D groups connected, first times flat against 2D on the
    /// first channel's groups (on `stream`), keeps what its rounds decide in the
    /// settings the channels are built with and says why in `auto_choice`;
    /// when flat wins, the 2D communicators are closed.
    fn open<K: Kernels<Buffer = B>>(
        &mut self,
        kernels: &K,
        mut comms: Vec<Comms>,
        stream: Option<usize>,
    ) -> Result<()> {
        if let (Some(bytes), Some(first)) = (self.setup.auto_probe_bytes(), comms.first_mut()) {
            let stream = stream.ok_or_else(no_stream)?;
            let probe = self.channels.probe(kernels, first, bytes, stream)?;
            // The device engine's channels do not take turns on the link.
            if !self.setup.adopt(&probe, false) {
                self.channels.drop_two_d(kernels, &mut comms);
            }
        }
        self.channels.open(comms, self.setup.settings);
        Ok(())
    }
}

fn not_nccl() -> Error {
    Error::InvalidArgument(
        "connect_store() needs an unconnected engine with transport 'nccl'".into(),
    )
}

fn not_tcp() -> Error {
    Error::InvalidArgument(
        "connect_store() needs an unconnected engine with transport 'tcp'".into(),
    )
}

fn no_stream() -> Error {
    Error::InvalidArgument("the algorithm probe needs the stream the caller runs on".into())
}

#[cfg(test)]
mod tests;
