//! Building the TCP rings: listen, exchange addresses (through the caller's
//! store), connect to the next rank and accept from the previous one.
//!
//! Every connection opens with a hello carrying the job's random token, the
//! sender's rank and the channel. A connection whose hello is wrong (another
//! job, a port scanner, a stale process) is dropped and logged; rendezvous
//! goes on waiting for the right peer until the deadline.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::Duration;

use super::ring::TcpRing;
use crate::comm::transport::Deadline;
use crate::error::{Error, Result};

/// Length of the per-job token.
pub const TOKEN_LEN: usize = 16;
const MAGIC: &[u8; 8] = b"TIACCv1\0";
const HELLO_LEN: usize = 8 + TOKEN_LEN + 12;
/// How long an accepted connection may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// A fresh random job token from the operating system.
pub fn random_token() -> Result<[u8; TOKEN_LEN]> {
    let mut token = [0u8; TOKEN_LEN];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut token))
        .map_err(|e| Error::io("/dev/urandom", e))?;
    Ok(token)
}

/// The local address that routes to `host:port` (no packet is sent: a UDP
/// `connect` only picks the route). Falls back to loopback when `host` is
/// loopback or unreachable.
pub fn local_addr_towards(host: &str, port: u16) -> IpAddr {
    let probe = || -> std::io::Result<IpAddr> {
        let target = std::net::ToSocketAddrs::to_socket_addrs(&(host, port))?
            .next()
            .ok_or_else(|| std::io::Error::new(ErrorKind::NotFound, "no address"))?;
        let bind: SocketAddr = if target.is_ipv4() {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let socket = UdpSocket::bind(bind)?;
        socket.connect(target)?;
        Ok(socket.local_addr()?.ip())
    };
    probe().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// A bound listening socket waiting for the ring to be formed.
pub struct RingListener {
    listener: TcpListener,
    addr: SocketAddr,
}

impl RingListener {
    /// Listens on an ephemeral port of `ip`.
    pub fn bind(ip: IpAddr) -> Result<Self> {
        let listener = TcpListener::bind((ip, 0)).map_err(|e| Error::Comm {
            peer: None,
            message: format!("cannot listen on {ip}: {e}"),
        })?;
        let addr = listener.local_addr().map_err(|e| Error::Comm {
            peer: None,
            message: format!("cannot read the listening address on {ip}: {e}"),
        })?;
        Ok(RingListener { listener, addr })
    }

    /// The address peers connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connects `channels` rings: to `addrs[rank + 1]` and from
    /// `addrs[rank - 1]`, presenting and checking `token`. Returns one
    /// [`TcpRing`] per channel.
    pub fn connect(
        self,
        addrs: &[SocketAddr],
        rank: usize,
        token: &[u8; TOKEN_LEN],
        channels: usize,
        deadline: Deadline,
    ) -> Result<Vec<TcpRing>> {
        let size = addrs.len();
        if rank >= size || channels == 0 {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of {size} with {channels} channels cannot form a ring"
            )));
        }
        if size == 1 {
            return Ok((0..channels)
                .map(|c| TcpRing::new(rank, size, c, None, None))
                .collect());
        }
        let next_rank = (rank + 1) % size;
        let prev_rank = (rank + size - 1) % size;

        // Outgoing first: connect() completes through the peer's accept
        // backlog, so no rank waits on another's accept loop here.
        let mut outgoing = Vec::with_capacity(channels);
        for channel in 0..channels {
            let stream = connect_with_retry(addrs[next_rank], next_rank, rank, deadline)?;
            let mut hello = Vec::with_capacity(HELLO_LEN);
            hello.extend_from_slice(MAGIC);
            hello.extend_from_slice(token);
            hello.extend_from_slice(&(rank as u32).to_le_bytes());
            hello.extend_from_slice(&(size as u32).to_le_bytes());
            hello.extend_from_slice(&(channel as u32).to_le_bytes());
            (&stream).write_all(&hello).map_err(|e| {
                comm(
                    rank,
                    Some(next_rank),
                    format!("cannot greet rank {next_rank} at {}: {e}", addrs[next_rank]),
                )
            })?;
            outgoing.push(stream);
        }

        let mut incoming: Vec<Option<TcpStream>> = (0..channels).map(|_| None).collect();
        let mut missing = channels;
        self.listener
            .set_nonblocking(true)
            .map_err(|e| comm(rank, None, format!("cannot configure the listener: {e}")))?;
        while missing > 0 {
            let (stream, from) = match self.listener.accept() {
                Ok(pair) => pair,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                    if deadline.remaining().is_zero() {
                        return Err(Error::CommTimeout {
                            peer: prev_rank,
                            message: format!(
                                "rank {rank}: rendezvous timed out after {:.1}s: rank {prev_rank} \
                                 opened {} of {channels} connections to {}",
                                deadline.timeout.as_secs_f64(),
                                channels - missing,
                                self.addr
                            ),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                Err(e) => {
                    return Err(comm(
                        rank,
                        None,
                        format!("accept failed on {}: {e}", self.addr),
                    ))
                }
            };
            match read_hello(&stream, token, size, deadline) {
                Ok((peer, channel)) if peer == prev_rank && channel < channels => {
                    if incoming[channel].is_some() {
                        log_rejected(
                            rank,
                            from,
                            &format!("a second connection for channel {channel}"),
                        );
                        continue;
                    }
                    incoming[channel] = Some(stream);
                    missing -= 1;
                }
                Ok((peer, channel)) => log_rejected(
                    rank,
                    from,
                    &format!(
                        "it says it is rank {peer} channel {channel}, expected rank {prev_rank}"
                    ),
                ),
                Err(reason) => log_rejected(rank, from, &reason),
            }
        }

        let mut rings = Vec::with_capacity(channels);
        for (channel, (next, prev)) in outgoing.into_iter().zip(incoming).enumerate() {
            let Some(prev) = prev else {
                return Err(comm(
                    rank,
                    Some(prev_rank),
                    format!("channel {channel} has no connection"),
                ));
            };
            for (stream, peer) in [(&next, next_rank), (&prev, prev_rank)] {
                stream
                    .set_nonblocking(true)
                    .and_then(|()| stream.set_nodelay(true))
                    .map_err(|e| {
                        comm(
                            rank,
                            Some(peer),
                            format!("cannot configure the connection to rank {peer}: {e}"),
                        )
                    })?;
            }
            rings.push(TcpRing::new(rank, size, channel, Some(next), Some(prev)));
        }
        Ok(rings)
    }
}

fn comm(rank: usize, peer: Option<usize>, what: String) -> Error {
    Error::Comm {
        peer,
        message: format!("rank {rank}: {what}"),
    }
}

/// Rejected connections are logged on stderr: they mean another job or a
/// stranger is talking to this port, which an operator wants to know.
fn log_rejected(rank: usize, from: SocketAddr, reason: &str) {
    eprintln!("tiacc_training: rank {rank} dropped a connection from {from}: {reason}");
}

fn connect_with_retry(
    addr: SocketAddr,
    peer: usize,
    rank: usize,
    deadline: Deadline,
) -> Result<TcpStream> {
    loop {
        let attempt = deadline.remaining().min(Duration::from_secs(10));
        let err = match TcpStream::connect_timeout(&addr, attempt.max(Duration::from_millis(1))) {
            Ok(stream) => return Ok(stream),
            Err(e) => e,
        };
        if deadline.remaining().is_zero() {
            return Err(Error::CommTimeout {
                peer,
                message: format!(
                    "rank {rank}: rendezvous timed out after {:.1}s connecting to rank {peer} at {addr}: {err}",
                    deadline.timeout.as_secs_f64()
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Reads and checks a hello; `Err` holds why the connection is refused.
fn read_hello(
    stream: &TcpStream,
    token: &[u8; TOKEN_LEN],
    size: usize,
    deadline: Deadline,
) -> std::result::Result<(usize, usize), String> {
    let wait = deadline
        .remaining()
        .min(HELLO_TIMEOUT)
        .max(Duration::from_millis(1));
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(wait)))
        .map_err(|e| format!("cannot configure it: {e}"))?;
    let mut hello = [0u8; HELLO_LEN];
    (&*stream)
        .read_exact(&mut hello)
        .map_err(|e| format!("no complete hello within {:.1}s ({e})", wait.as_secs_f64()))?;
    stream
        .set_read_timeout(None)
        .map_err(|e| format!("cannot configure it: {e}"))?;
    if &hello[..8] != MAGIC {
        return Err("not a tiacc_training connection (bad magic)".to_string());
    }
    if hello[8..8 + TOKEN_LEN] != token[..] {
        return Err("wrong job token".to_string());
    }
    let u32_at = |i: usize| {
        u32::from_le_bytes([hello[i], hello[i + 1], hello[i + 2], hello[i + 3]]) as usize
    };
    let (peer, peer_size, channel) = (u32_at(24), u32_at(28), u32_at(32));
    if peer_size != size {
        return Err(format!(
            "it belongs to a group of {peer_size} ranks, this one has {size}"
        ));
    }
    Ok((peer, channel))
}
