//! Device keys and memory budgets, in Accelerate's normalised order.

use std::fmt;

use crate::Error;
use crate::size::{parse_size_text, parse_size_value};

/// Where a module goes: a GPU, host RAM or the offload folder on disk.
///
/// The derived order is Accelerate's normalised order: GPUs by ordinal, then
/// `cpu`, then `disk` (`mps` is not supported).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// A GPU, by ordinal.
    Gpu(u32),
    /// Host RAM.
    Cpu,
    /// The offload folder.
    Disk,
}

impl Device {
    /// Parses a `max_memory` / device-map key: an integer, `cpu` or `disk`.
    /// Anything else (`cuda:0`, `gpu`, `mps`) is rejected with Accelerate's
    /// message.
    pub fn parse_key(key: &str) -> Result<Device, Error> {
        let key = key.trim();
        match key {
            "cpu" => Ok(Device::Cpu),
            "disk" => Ok(Device::Disk),
            _ if !key.is_empty() && key.bytes().all(|b| b.is_ascii_digit()) => key
                .parse::<u32>()
                .map(Device::Gpu)
                .map_err(|_| Error::UnknownDevice(key.to_string())),
            _ => Err(Error::UnknownDevice(key.to_string())),
        }
    }

    /// Parses a device-map value: a JSON integer, `"cpu"`, `"disk"`, or a
    /// string holding an integer or `cuda:N`.
    pub fn from_json(value: &serde_json::Value) -> Result<Device, Error> {
        match value {
            serde_json::Value::Number(n) => n
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .map(Device::Gpu)
                .ok_or_else(|| Error::UnknownDevice(n.to_string())),
            serde_json::Value::String(s) => {
                let s = s.strip_prefix("cuda:").unwrap_or(s);
                Device::parse_key(s)
            }
            other => Err(Error::UnknownDevice(other.to_string())),
        }
    }

    /// The JSON form transformers' `hf_device_map` uses: an integer for a
    /// GPU, a string otherwise.
    pub fn to_json(self) -> serde_json::Value {
        match self {
            Device::Gpu(i) => serde_json::Value::from(i),
            Device::Cpu => "cpu".into(),
            Device::Disk => "disk".into(),
        }
    }

    /// True for GPUs.
    pub fn is_gpu(self) -> bool {
        matches!(self, Device::Gpu(_))
    }

    /// Where a model placed on `devices` executes (bm-dispatch's execution
    /// device): the lowest GPU among them, else the CPU.
    pub fn execution(devices: impl IntoIterator<Item = Device>) -> Device {
        devices
            .into_iter()
            .filter(|d| d.is_gpu())
            .min()
            .unwrap_or(Device::Cpu)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Gpu(i) => write!(f, "{i}"),
            Device::Cpu => f.write_str("cpu"),
            Device::Disk => f.write_str("disk"),
        }
    }
}

/// A byte budget per device, in normalised order, each device at most once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MaxMemory {
    entries: Vec<(Device, u64)>,
}

impl MaxMemory {
    /// Builds from pairs; sorts them into normalised order. A device given
    /// twice is an error.
    pub fn new(pairs: impl IntoIterator<Item = (Device, u64)>) -> Result<Self, Error> {
        let mut entries: Vec<(Device, u64)> = pairs.into_iter().collect();
        entries.sort_by_key(|(d, _)| *d);
        if let Some(w) = entries.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::BadMemorySpec(format!(
                "device {} is given twice",
                w[0].0
            )));
        }
        Ok(MaxMemory { entries })
    }

    /// Parses `0=10GiB,1=10GiB,cpu=30GiB,disk=200GB` or a JSON object
    /// `{"0": "10GiB", "cpu": 1000}`.
    pub fn parse(spec: &str) -> Result<Self, Error> {
        let spec = spec.trim();
        if spec.starts_with('{') {
            let value: serde_json::Value = serde_json::from_str(spec)
                .map_err(|e| Error::BadMemorySpec(format!("{spec:?} is not valid JSON: {e}")))?;
            let object = value
                .as_object()
                .ok_or_else(|| Error::BadMemorySpec("expected a JSON object".into()))?;
            let mut pairs = Vec::with_capacity(object.len());
            for (key, size) in object {
                let device = Device::parse_key(key)?;
                pairs.push((
                    device,
                    parse_size_value(size, key).map_err(naming_device(key))?,
                ));
            }
            return MaxMemory::new(pairs);
        }
        if spec.is_empty() {
            return Err(Error::BadMemorySpec("empty specification".into()));
        }
        let mut pairs = Vec::new();
        for item in spec.split(',') {
            let (key, size) = item.split_once('=').ok_or_else(|| {
                Error::BadMemorySpec(format!("{item:?} is not KEY=SIZE (e.g. 0=10GiB,cpu=30GiB)"))
            })?;
            let device = Device::parse_key(key)?;
            pairs.push((
                device,
                parse_size_text(size, key.trim()).map_err(naming_device(key.trim()))?,
            ));
        }
        MaxMemory::new(pairs)
    }

    /// The budgets in normalised order.
    pub fn iter(&self) -> impl Iterator<Item = (Device, u64)> + '_ {
        self.entries.iter().copied()
    }

    /// The budget of `device`, if it has one.
    pub fn get(&self, device: Device) -> Option<u64> {
        self.entries
            .iter()
            .find(|(d, _)| *d == device)
            .map(|(_, b)| *b)
    }

    /// Sets the budget of `device`, keeping the order.
    pub fn set(&mut self, device: Device, bytes: u64) {
        match self.entries.binary_search_by_key(&device, |(d, _)| *d) {
            Ok(i) => self.entries[i].1 = bytes,
            Err(i) => self.entries.insert(i, (device, bytes)),
        }
    }

    /// The devices in normalised order.
    pub fn devices(&self) -> impl Iterator<Item = Device> + '_ {
        self.entries.iter().map(|(d, _)| *d)
    }

    /// The GPUs, by ordinal.
    pub fn gpus(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.entries.iter().filter_map(|(d, b)| match d {
            Device::Gpu(i) => Some((*i, *b)),
            _ => None,
        })
    }

    /// True when no device has a budget.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The JSON object form, `{"0": bytes, "cpu": bytes}`.
    pub fn to_json(&self) -> serde_json::Value {
        let mut object = serde_json::Map::new();
        for (d, b) in &self.entries {
            object.insert(d.to_string(), (*b).into());
        }
        serde_json::Value::Object(object)
    }
}

/// A size that does not parse names the device it was given for
/// (`--max-memory 0=` says which key has no size).
fn naming_device(key: &str) -> impl Fn(Error) -> Error + '_ {
    move |e| match e {
        Error::BadSize(size) => Error::BadBudget {
            what: key.to_string(),
            reason: format!(
                "{size:?} is not in a valid format; use an integer for bytes, or a string with a unit (like '5.0GB')"
            ),
        },
        other => other,
    }
}

/// Per-device byte reserves (`--reserve 0=2GiB,cpu=1GiB`), same syntax as
/// [`MaxMemory::parse`].
pub fn parse_reserve(spec: &str) -> Result<MaxMemory, Error> {
    MaxMemory::parse(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_normalised_gpus_first_then_cpu_then_disk() {
        let m = MaxMemory::parse("disk=200GB,cpu=30GiB,1=10GiB,0=10GiB").unwrap();
        let devices: Vec<_> = m.devices().collect();
        assert_eq!(
            devices,
            vec![Device::Gpu(0), Device::Gpu(1), Device::Cpu, Device::Disk]
        );
        assert_eq!(m.get(Device::Disk), Some(200_000_000_000));
        let j = MaxMemory::parse(r#"{"cpu": 1000, "0": "1KB"}"#).unwrap();
        assert_eq!(
            j.iter().collect::<Vec<_>>(),
            vec![(Device::Gpu(0), 1000), (Device::Cpu, 1000)]
        );
    }

    #[test]
    fn unknown_keys_are_rejected_naming_what_is_available() {
        for key in ["cuda:0", "gpu", "-1"] {
            let err = MaxMemory::parse(&format!("{key}=10GiB")).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "Device {key} is not recognized, available devices are integers (GPU ordinals), 'cpu' and 'disk'"
                )
            );
        }
        // Accelerate's message would list 'mps' as available.
        let err = MaxMemory::parse("mps=10GiB").unwrap_err().to_string();
        assert!(err.contains("mps (Apple Metal) is not supported"), "{err}");
        assert!(!err.contains("'mps'"), "{err}");
        assert!(MaxMemory::parse("0=10GiB,0=1GB").is_err());
        assert!(MaxMemory::parse("0").is_err());
        assert!(
            MaxMemory::parse("0=ten")
                .unwrap_err()
                .to_string()
                .contains("not in a valid format")
        );
        assert!(MaxMemory::parse("{").is_err());
    }

    #[test]
    fn a_missing_or_bad_size_names_its_device() {
        for (spec, key) in [
            ("0=", "0"),
            ("cpu=,0=1GB", "cpu"),
            ("0=1GB, disk = lots", "disk"),
            (r#"{"1": "x"}"#, "1"),
        ] {
            let err = MaxMemory::parse(spec).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("bad memory budget for {key}: "))
                    && err.contains("is not in a valid format"),
                "{spec}: {err}"
            );
        }
    }
}
