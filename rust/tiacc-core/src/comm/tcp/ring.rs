//! The TCP transport: a ring of connections, one per channel.
//!
//! Each rank sends to `rank + 1` and receives from `rank - 1` over two
//! non-blocking sockets driven by `poll(2)` from one thread, so sending and
//! receiving overlap and every wait is bounded by the deadline. Collectives
//! are sequences of ring steps (see [`Step`]) streamed back to back: a step
//! forwards what the previous step received, as soon as it is received,
//! which pipelines the ring without a fixed chunk size.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::ops::Range;
use std::os::fd::AsRawFd;

use crate::comm::dtype::{shard_range, DType, ReduceOp};
use crate::comm::transport::{
    check_agreement, check_root, Aborter, Deadline, Failed, OpTag, Reduction, Transport,
};
use crate::error::{Error, Result};

/// One ring step: send `send` (bytes of the buffer) to the next rank while
/// receiving `recv` from the previous one, summed into the buffer when
/// `reduce`, else copied. Step `s + 1` sends what step `s` received, so it
/// may send each byte as soon as that byte has been received and reduced.
#[derive(Debug, Clone)]
struct Step {
    send: Range<usize>,
    recv: Range<usize>,
    reduce: bool,
}

/// A ring over TCP for one channel of one group.
#[derive(Debug)]
pub struct TcpRing {
    rank: usize,
    size: usize,
    channel: usize,
    /// Connection to `rank + 1` (we only write to it).
    next: Option<TcpStream>,
    /// Connection from `rank - 1` (we only read from it).
    prev: Option<TcpStream>,
    /// Receive staging for reduce steps.
    stage: Vec<u8>,
    /// Set once a collective failed: the ring's streams are out of step.
    broken: Failed,
    /// Payload bytes written to `next` so far (headers not counted).
    sent: u64,
    /// The world rank of each member and the group's name, for messages
    /// (a 2D ring's ranks are its members' indices).
    members: Vec<usize>,
    group: &'static str,
    /// The IP addresses of the next and previous ranks, for messages.
    next_host: String,
    prev_host: String,
}

/// A neighbour in a message: its world rank and host.
#[derive(Debug, Clone, Copy)]
struct Peer<'a> {
    rank: usize,
    host: &'a str,
}

impl std::fmt::Display for Peer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} at {}", self.rank, self.host)
    }
}

fn host_of(stream: Option<&TcpStream>) -> String {
    stream
        .and_then(|s| s.peer_addr().ok())
        .map_or_else(|| "an unknown host".to_string(), |a| a.ip().to_string())
}

impl TcpRing {
    /// A ring from connected, non-blocking sockets (see `rendezvous`).
    /// `size == 1` needs no sockets.
    pub(crate) fn new(
        rank: usize,
        size: usize,
        channel: usize,
        next: Option<TcpStream>,
        prev: Option<TcpStream>,
    ) -> Self {
        TcpRing {
            rank,
            size,
            channel,
            next_host: host_of(next.as_ref()),
            prev_host: host_of(prev.as_ref()),
            next,
            prev,
            stage: Vec::new(),
            broken: Failed::default(),
            sent: 0,
            members: (0..size).collect(),
            group: "world",
        }
    }

    /// Names the group and its members' world ranks in messages.
    pub fn with_members(mut self, group: &'static str, members: Vec<usize>) -> Self {
        if members.len() == self.size {
            self.members = members;
            self.group = group;
        }
        self
    }

    /// The channel this ring serves.
    pub fn channel(&self) -> usize {
        self.channel
    }

    /// The world rank of each member.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// This rank's own address on the ring, for messages.
    pub fn local_host(&self) -> String {
        self.next
            .as_ref()
            .and_then(|s| s.local_addr().ok())
            .map_or_else(|| "an unknown host".to_string(), |a| a.ip().to_string())
    }

    /// The group's name in messages ("world", "intra-node", "inter-node").
    pub fn group(&self) -> &'static str {
        self.group
    }

    /// The world rank of member `r`.
    fn world(&self, r: usize) -> usize {
        self.members.get(r).copied().unwrap_or(r)
    }

    fn next_rank(&self) -> usize {
        (self.rank + 1) % self.size
    }

    fn prev_rank(&self) -> usize {
        (self.rank + self.size - 1) % self.size
    }

    /// Byte range of shard `index` of a buffer of `len_elems` elements.
    fn shard(&self, len_elems: usize, elem: usize, index: usize) -> Range<usize> {
        let r = shard_range(len_elems, self.size, index % self.size);
        r.start * elem..r.end * elem
    }

    fn reduce_scatter_steps(&self, len_elems: usize, elem: usize) -> Vec<Step> {
        let (p, r) = (self.size, self.rank);
        (0..p - 1)
            .map(|s| Step {
                send: self.shard(len_elems, elem, r + 2 * p - s - 1),
                recv: self.shard(len_elems, elem, r + 2 * p - s - 2),
                reduce: true,
            })
            .collect()
    }

    fn allgather_steps(&self, len_elems: usize, elem: usize) -> Vec<Step> {
        let (p, r) = (self.size, self.rank);
        (0..p - 1)
            .map(|s| Step {
                send: self.shard(len_elems, elem, r + 2 * p - s),
                recv: self.shard(len_elems, elem, r + 2 * p - s - 1),
                reduce: false,
            })
            .collect()
    }

    /// Runs the steps that `steps` makes for this ring over `buf` as one
    /// guarded collective; a ring of one only checks that it is usable.
    fn run_steps(
        &mut self,
        buf: &mut [u8],
        steps: impl FnOnce(&Self) -> Vec<Step>,
        reduce: Option<(DType, ReduceOp)>,
        tag: Option<&OpTag>,
        what: &str,
        deadline: Deadline,
    ) -> Result<()> {
        if self.size == 1 {
            return self.check_usable();
        }
        self.guarded(|ring| {
            let steps = steps(ring);
            ring.run(buf, &steps, reduce, tag, what, deadline)
        })
    }

    fn check_usable(&self) -> Result<()> {
        self.broken
            .check(|what| format!("rank {} channel {}: {what}", self.rank, self.channel))
    }

    /// Runs `f`; if it fails, the ring is marked unusable. The sockets stay
    /// open until the owner calls [`Transport::abort`], so that the engine
    /// can publish the failure before peers see the ring break.
    fn guarded(&mut self, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        self.check_usable()?;
        let result = f(self);
        if let Err(err) = &result {
            self.broken.record(err);
        }
        result
    }

    fn ctx(&self, what: &str) -> String {
        let ring = if self.group == "world" {
            String::new()
        } else {
            format!(" ({} ring)", self.group)
        };
        format!(
            "rank {} channel {}{ring}: {what}",
            self.world(self.rank),
            self.channel
        )
    }

    /// Streams `steps` through the ring. `elem` is the element size used to
    /// reduce whole elements as they arrive.
    ///
    /// With `header`, each rank first sends its tag to the next rank, ahead
    /// of its data on the same stream, and checks the previous rank's tag
    /// before reading any data: the check costs no extra round trip. A
    /// mismatch anywhere in the ring is seen by at least one rank, which
    /// aborts, so every rank fails.
    fn run(
        &mut self,
        buf: &mut [u8],
        steps: &[Step],
        reduce: Option<(DType, ReduceOp)>,
        header: Option<&OpTag>,
        what: &str,
        deadline: Deadline,
    ) -> Result<()> {
        let n = steps.len();
        if n == 0 && header.is_none() {
            return Ok(());
        }
        let ctx = self.ctx(what);
        let (Some(next), Some(prev)) = (self.next.as_ref(), self.prev.as_ref()) else {
            return Err(Error::Comm {
                peer: None,
                message: format!("{ctx}: the ring is not connected"),
            });
        };
        // World ranks, for messages.
        let (next_rank, prev_rank) = (self.world(self.next_rank()), self.world(self.prev_rank()));
        let me = self.world(self.rank);
        let next_peer = Peer {
            rank: next_rank,
            host: &self.next_host,
        };
        let prev_peer = Peer {
            rank: prev_rank,
            host: &self.prev_host,
        };
        let elem = reduce.map_or(1, |(d, _)| d.size());
        let stage_len = steps
            .iter()
            .filter(|s| s.reduce)
            .map(|s| s.recv.len())
            .max()
            .unwrap_or(0);
        if self.stage.len() < stage_len {
            self.stage.resize(stage_len, 0);
        }
        let stage = &mut self.stage;

        // Send cursor: step and bytes of it sent. Receive cursor: step,
        // bytes received, bytes committed (reduced or copied in place).
        let (mut s_step, mut s_off) = (0usize, 0usize);
        let (mut r_step, mut r_got, mut r_done) = (0usize, 0usize, 0usize);
        // Header cursors: bytes of our tag sent, of the previous rank's read.
        let hdr_len = header.map_or(0, |_| OpTag::LEN);
        let send_hdr = header.map(OpTag::encode).unwrap_or([0u8; OpTag::LEN]);
        let mut recv_hdr = [0u8; OpTag::LEN];
        let (mut s_hdr, mut r_hdr) = (0usize, 0usize);
        loop {
            // Skip finished and empty steps.
            while s_step < n && s_off == steps[s_step].send.len() {
                s_step += 1;
                s_off = 0;
            }
            while r_step < n && r_done == steps[r_step].recv.len() {
                r_step += 1;
                r_got = 0;
                r_done = 0;
            }
            if s_step == n && r_step == n && s_hdr == hdr_len && r_hdr == hdr_len {
                return Ok(());
            }
            // Step s may send what step s-1 has committed so far.
            let send_limit = if s_step == n {
                0
            } else if s_step == 0 || r_step > s_step - 1 {
                steps[s_step].send.len()
            } else {
                r_done
            };
            let want_send = s_hdr < hdr_len || (s_step < n && s_off < send_limit);
            // Step r may receive into the buffer only once every earlier
            // step's send is done, since later steps overwrite shards that
            // earlier steps sent.
            let want_recv = r_hdr < hdr_len || (r_step < n && s_step >= r_step);

            let mut progressed = false;
            if s_hdr < hdr_len {
                let k = send_some(next, &send_hdr[s_hdr..], &ctx, next_peer)?;
                s_hdr += k;
                progressed |= k > 0;
            } else if want_send {
                let range = &steps[s_step].send;
                let chunk = &buf[range.start + s_off..range.start + send_limit];
                let k = send_some(next, chunk, &ctx, next_peer)?;
                s_off += k;
                self.sent += k as u64;
                progressed |= k > 0;
            }
            if r_hdr < hdr_len {
                let k = recv_some(prev, &mut recv_hdr[r_hdr..], &ctx, prev_peer)?;
                r_hdr += k;
                progressed |= k > 0;
                if k > 0 && r_hdr == hdr_len {
                    if let Some(mine) = header {
                        check_neighbour_tag(&ctx, mine, &recv_hdr, me, prev_rank)?;
                    }
                }
            } else if want_recv {
                let step = &steps[r_step];
                let want = step.recv.len() - r_got;
                let into = if step.reduce {
                    &mut stage[r_got..r_got + want]
                } else {
                    let at = step.recv.start + r_got;
                    &mut buf[at..at + want]
                };
                let k = recv_some(prev, into, &ctx, prev_peer)?;
                r_got += k;
                progressed |= k > 0;
                let ready = if step.reduce {
                    r_got - r_got % elem
                } else {
                    r_got
                };
                if step.reduce && ready > r_done {
                    let at = step.recv.start;
                    let (d, op) = reduce.unwrap_or((DType::F32, ReduceOp::Sum));
                    d.reduce_assign(op, &mut buf[at + r_done..at + ready], &stage[r_done..ready]);
                }
                r_done = ready;
            }
            if progressed {
                continue;
            }
            // Nothing moved: wait until a socket is ready or time runs out.
            let waiting_on = if want_recv { prev_peer } else { next_peer };
            let remaining = deadline.remaining();
            if remaining.is_zero() {
                let detail = if r_hdr < hdr_len {
                    format!("the header of rank {prev_rank}'s collective has not arrived")
                } else if want_recv {
                    format!(
                        "received {r_got} of {} bytes of step {}/{n} from rank {prev_rank}",
                        steps[r_step].recv.len(),
                        r_step + 1
                    )
                } else {
                    format!("rank {next_rank} stopped accepting data")
                };
                return Err(Error::CommTimeout {
                    peer: waiting_on.rank,
                    message: format!(
                        "{ctx}: timed out after {:.1}s waiting for {waiting_on} ({detail})",
                        deadline.timeout.as_secs_f64()
                    ),
                });
            }
            wait_ready(
                want_send.then(|| next.as_raw_fd()),
                want_recv.then(|| prev.as_raw_fd()),
                remaining,
            )
            .map_err(|e| io_failure(&ctx, waiting_on, "wait for", &e))?;
        }
    }
}

/// Compares the previous rank's tag with ours.
fn check_neighbour_tag(
    ctx: &str,
    mine: &OpTag,
    theirs: &[u8],
    rank: usize,
    prev: usize,
) -> Result<()> {
    let theirs = OpTag::decode(theirs);
    if theirs == Some(*mine) {
        return Ok(());
    }
    let what = theirs.map_or("an unreadable header".to_string(), |t| t.describe());
    Err(Error::Comm {
        peer: Some(prev),
        message: format!(
            "{ctx}: ranks disagree on the next collective (different bucket layouts or a \
             different order of calls): rank {prev} issued {what}; rank {rank} issued {}",
            mine.describe()
        ),
    })
}

/// Writes what the socket takes now: bytes written, 0 if it would block.
fn send_some(stream: &TcpStream, bytes: &[u8], ctx: &str, peer: Peer) -> Result<usize> {
    match (&*stream).write(bytes) {
        Ok(0) => Err(closed(ctx, peer, "while sending")),
        Ok(k) => Ok(k),
        Err(e) if retryable(&e) => Ok(0),
        Err(e) => Err(io_failure(ctx, peer, "send to", &e)),
    }
}

/// Reads what has arrived: bytes read, 0 if nothing is there yet (a closed
/// connection is an error, since we only read bytes we still expect).
fn recv_some(stream: &TcpStream, into: &mut [u8], ctx: &str, peer: Peer) -> Result<usize> {
    match (&*stream).read(into) {
        Ok(0) => Err(closed(ctx, peer, "while receiving")),
        Ok(k) => Ok(k),
        Err(e) if retryable(&e) => Ok(0),
        Err(e) => Err(io_failure(ctx, peer, "receive from", &e)),
    }
}

fn retryable(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted)
}

fn closed(ctx: &str, peer: Peer, when: &str) -> Error {
    Error::Comm {
        peer: Some(peer.rank),
        message: format!(
            "{ctx}: {peer} closed its connection {when} (it exited or failed; see its own error)"
        ),
    }
}

fn io_failure(ctx: &str, peer: Peer, verb: &str, e: &std::io::Error) -> Error {
    let cause = match e.kind() {
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted => {
            " (it exited or failed; see its own error)"
        }
        _ => "",
    };
    Error::Comm {
        peer: Some(peer.rank),
        message: format!("{ctx}: cannot {verb} {peer}: {e}{cause}"),
    }
}

/// Blocks until `write_fd` is writable or `read_fd` readable (or either has
/// an error or hang-up pending, which the next read/write then reports), or
/// until `timeout` passes.
fn wait_ready(
    write_fd: Option<i32>,
    read_fd: Option<i32>,
    timeout: std::time::Duration,
) -> std::io::Result<()> {
    let mut fds = Vec::with_capacity(2);
    if let Some(fd) = write_fd {
        fds.push(libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        });
    }
    if let Some(fd) = read_fd {
        fds.push(libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
    }
    // Round up so a sub-millisecond remainder still waits instead of spinning.
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: `fds` is a valid, exclusively borrowed array of `fds.len()`
    // initialised pollfd structs that outlives the call; the descriptors are
    // owned by live TcpStreams.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if rc < 0 {
        let err = std::io::Error::last_os_error();
        if err.kind() != ErrorKind::Interrupted {
            return Err(err);
        }
    }
    Ok(())
}

impl Transport for TcpRing {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn medium(&self) -> &'static str {
        "tcp"
    }

    fn bytes_sent(&self) -> u64 {
        self.sent
    }

    fn agree(&mut self, tag: &OpTag, deadline: Deadline) -> Result<()> {
        if self.size == 1 {
            return self.check_usable();
        }
        let mut all = vec![0u8; OpTag::LEN * self.size];
        all[self.rank * OpTag::LEN..(self.rank + 1) * OpTag::LEN].copy_from_slice(&tag.encode());
        // Headers are not payload (see `bytes_sent`).
        let sent = self.sent;
        let result = self.guarded(|ring| {
            let steps = ring.allgather_steps(ring.size, OpTag::LEN);
            ring.run(
                &mut all,
                &steps,
                None,
                None,
                "exchanging collective headers",
                deadline,
            )?;
            let tags: Vec<Option<OpTag>> =
                all.chunks_exact(OpTag::LEN).map(OpTag::decode).collect();
            check_agreement(&tags, tag, |r| ring.world(r), |m| ring.ctx(m))
        });
        self.sent = sent;
        result
    }

    fn allreduce_with(&mut self, buf: &mut [u8], how: &Reduction) -> Result<()> {
        // Reduce-scatter then allgather as one stream, led by the tag if any.
        how.divide(buf);
        let size = how.dtype.size();
        let elems = buf.len() / size;
        let steps = |ring: &Self| {
            let mut steps = ring.reduce_scatter_steps(elems, size);
            steps.extend(ring.allgather_steps(elems, size));
            steps
        };
        let reduce = Some((how.dtype, how.op));
        self.run_steps(buf, steps, reduce, how.tag, "allreduce", how.deadline)
    }

    fn reduce_scatter_with(&mut self, buf: &mut [u8], how: &Reduction) -> Result<()> {
        how.divide(buf);
        let size = how.dtype.size();
        let elems = buf.len() / size;
        let steps = |ring: &Self| ring.reduce_scatter_steps(elems, size);
        let reduce = Some((how.dtype, how.op));
        self.run_steps(buf, steps, reduce, how.tag, "reduce-scatter", how.deadline)
    }

    fn allgather(&mut self, buf: &mut [u8], elem_size: usize, deadline: Deadline) -> Result<()> {
        let elem = elem_size.max(1);
        let elems = buf.len() / elem;
        let steps = |ring: &Self| ring.allgather_steps(elems, elem);
        self.run_steps(buf, steps, None, None, "allgather", deadline)
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize, deadline: Deadline) -> Result<()> {
        check_root(root, self.size)?;
        let len = buf.len();
        let steps = |ring: &Self| {
            let all = 0..len;
            let none = 0..0;
            // The root sends; every other rank receives and, unless the
            // next rank is the root, forwards while receiving.
            if ring.rank == root {
                vec![Step {
                    send: all,
                    recv: none,
                    reduce: false,
                }]
            } else {
                let forward = if ring.next_rank() == root {
                    none.clone()
                } else {
                    all.clone()
                };
                vec![
                    Step {
                        send: none.clone(),
                        recv: all,
                        reduce: false,
                    },
                    Step {
                        send: forward,
                        recv: none,
                        reduce: false,
                    },
                ]
            }
        };
        self.run_steps(buf, steps, None, None, "broadcast", deadline)
    }

    fn barrier(&mut self, deadline: Deadline) -> Result<()> {
        // An allgather of one byte per rank: nobody finishes before every
        // rank has contributed its byte.
        let mut bytes = vec![1u8; self.size];
        let steps = |ring: &Self| ring.allgather_steps(ring.size, 1);
        self.run_steps(&mut bytes, steps, None, None, "barrier", deadline)
    }

    fn abort(&mut self) {
        for stream in [self.next.as_ref(), self.prev.as_ref()]
            .into_iter()
            .flatten()
        {
            // Best effort: peers then see end-of-stream at once.
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        self.broken.aborted();
    }

    fn aborter(&self) -> Aborter {
        let streams: Vec<TcpStream> = [self.next.as_ref(), self.prev.as_ref()]
            .into_iter()
            .flatten()
            .filter_map(|s| s.try_clone().ok())
            .collect();
        Box::new(move || {
            for stream in &streams {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        })
    }
}
