//! Network interfaces by name: the host's list (getifaddrs) and the rules
//! by which an interface variable picks one.

use std::ffi::CStr;
use std::net::Ipv4Addr;

use super::NCCL_SOCKET_IFNAME;
use crate::error::{Error, Result};

/// One network interface of this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// Its name (`lo`, `eth0`, ...).
    pub name: String,
    /// Its first IPv4 address, if it has one.
    pub ipv4: Option<Ipv4Addr>,
}

impl Interface {
    /// An interface named `name` with `ipv4`.
    pub fn new(name: &str, ipv4: Option<Ipv4Addr>) -> Self {
        Interface {
            name: name.to_string(),
            ipv4,
        }
    }
}

/// This host's interfaces in the system's order, each once, with its first
/// IPv4 address.
pub fn system_interfaces() -> Result<Vec<Interface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::io(
            "getifaddrs (the list of network interfaces)",
            std::io::Error::last_os_error(),
        ));
    }
    let mut out: Vec<Interface> = Vec::new();
    let mut entry = head;
    while !entry.is_null() {
        // SAFETY: `entry` is a node of the list getifaddrs returned, alive
        // until freeifaddrs; its name is a NUL-terminated string and its
        // address, when not null, is a sockaddr_in when the family is AF_INET.
        let (name, ipv4, next) = unsafe {
            let e = &*entry;
            let name = CStr::from_ptr(e.ifa_name).to_string_lossy().into_owned();
            let addr = e.ifa_addr;
            let ipv4 = if !addr.is_null() && i32::from((*addr).sa_family) == libc::AF_INET {
                let sin = &*(addr as *const libc::sockaddr_in);
                Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            } else {
                None
            };
            (name, ipv4, e.ifa_next)
        };
        match out.iter_mut().find(|i| i.name == name) {
            Some(known) => known.ipv4 = known.ipv4.or(ipv4),
            None => out.push(Interface { name, ipv4 }),
        }
        entry = next;
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The IPv4 address `variable=value` picks among `interfaces`: for
/// `NCCL_SOCKET_IFNAME` NCCL's rule (a comma-separated list of name
/// prefixes; `=` first: exact names; `^` first: every interface but
/// those; the first interface in the system's order that matches and has
/// an IPv4 address), for the others the first name of a comma-separated
/// list, exactly. No match is an `Error::Config` listing the interfaces.
pub(super) fn resolve(variable: &str, value: &str, interfaces: &[Interface]) -> Result<Ipv4Addr> {
    let found = if variable == NCCL_SOCKET_IFNAME {
        let (exclude, rest) = match value.strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, value),
        };
        let (exact, rest) = match rest.strip_prefix('=') {
            Some(rest) => (true, rest),
            None => (false, rest),
        };
        let entries: Vec<&str> = rest
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .collect();
        let matches = |name: &str| {
            entries.iter().any(|e| {
                if exact {
                    name == *e
                } else {
                    name.starts_with(e)
                }
            })
        };
        interfaces
            .iter()
            .filter(|i| matches(&i.name) != exclude)
            .find_map(|i| i.ipv4)
    } else {
        let name = value.split(',').next().unwrap_or("").trim();
        interfaces
            .iter()
            .find(|i| i.name == name)
            .and_then(|i| i.ipv4)
    };
    found.ok_or_else(|| {
        let listed: Vec<String> = interfaces
            .iter()
            .map(|i| match i.ipv4 {
                Some(ip) => format!("{} ({ip})", i.name),
                None => format!("{} (no IPv4)", i.name),
            })
            .collect();
        Error::Config {
            variable: variable.to_string(),
            value: value.to_string(),
            expected: format!(
                "a network interface of this host with an IPv4 address; it has {}",
                listed.join(", ")
            ),
        }
    })
}
