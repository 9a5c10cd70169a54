//! Devices an engine runs on, as a type.
//!
//! This module owns the names: `cpu`, `cuda` / `cuda:<n>`, `vulkan` / `vulkan:<n>`, and
//! anything else an engine reports (the fake engine's `fake-gpu`) kept as written. [`Device`]'s `Display` and
//! `FromStr` give back the same strings, so events and metrics labels that carry a device
//! name do not change; code that asks "is this the CPU?" asks [`Device::is_cpu`] instead
//! of comparing strings.

use std::borrow::Cow;
use std::convert::Infallible;
use std::fmt;
use std::str::FromStr;

use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A compute device.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Device {
    /// The CPU: always there, the last rung of the out-of-memory ladder.
    Cpu,
    /// An NVIDIA GPU: `cuda` (the backend's default) or `cuda:<index>`.
    Cuda(Option<u32>),
    /// Any GPU with a Vulkan driver (AMD, Intel, NVIDIA, or Mesa's lavapipe on the CPU):
    /// `vulkan` (the engine's choice: a discrete GPU first) or `vulkan:<index>`, the
    /// index in the driver's list of Vulkan devices (`vulkaninfo --summary`'s `GPU<n>`).
    Vulkan(Option<u32>),
    /// Any other device an engine names (`fake-gpu`), kept as written.
    Other(String),
}

impl Device {
    /// True for the CPU.
    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(None) => f.write_str("cuda"),
            Device::Cuda(Some(i)) => write!(f, "cuda:{i}"),
            Device::Vulkan(None) => f.write_str("vulkan"),
            Device::Vulkan(Some(i)) => write!(f, "vulkan:{i}"),
            Device::Other(s) => f.write_str(s),
        }
    }
}

impl From<&str> for Device {
    fn from(s: &str) -> Device {
        match s {
            "cpu" => Device::Cpu,
            "cuda" => Device::Cuda(None),
            "vulkan" => Device::Vulkan(None),
            other => {
                if let Some(i) = index_after(other, "cuda:") {
                    Device::Cuda(Some(i))
                } else if let Some(i) = index_after(other, "vulkan:") {
                    Device::Vulkan(Some(i))
                } else {
                    Device::Other(other.to_string())
                }
            }
        }
    }
}

/// The index of `<prefix><index>`, in its canonical spelling only (no sign, no leading
/// zero), so that `Display` gives back the same string.
fn index_after(s: &str, prefix: &str) -> Option<u32> {
    let digits = s.strip_prefix(prefix)?;
    digits.parse::<u32>().ok().filter(|i| i.to_string() == digits)
}

impl FromStr for Device {
    type Err = Infallible;

    fn from_str(s: &str) -> Result<Device, Infallible> {
        Ok(Device::from(s))
    }
}

impl Serialize for Device {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Device {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Device, D::Error> {
        Ok(Device::from(String::deserialize(d)?.as_str()))
    }
}

/// A device is its name in JSON: the schema is a plain string, as it always was.
impl JsonSchema for Device {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        "Device".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        schemars::json_schema!({ "type": "string" })
    }
}

/// `device == "cpu"`: true when the name reads as this device.
impl PartialEq<str> for Device {
    fn eq(&self, other: &str) -> bool {
        match self {
            Device::Cpu => other == "cpu",
            Device::Cuda(None) => other == "cuda",
            Device::Cuda(Some(i)) => other.strip_prefix("cuda:") == Some(i.to_string().as_str()),
            Device::Vulkan(None) => other == "vulkan",
            Device::Vulkan(Some(i)) => other.strip_prefix("vulkan:") == Some(i.to_string().as_str()),
            Device::Other(s) => s == other,
        }
    }
}

impl PartialEq<&str> for Device {
    fn eq(&self, other: &&str) -> bool {
        self == *other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_the_names_engines_report_when_parsed_and_printed_then_they_are_unchanged() {
        for (name, device) in [
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(None)),
            ("cuda:0", Device::Cuda(Some(0))),
            ("cuda:12", Device::Cuda(Some(12))),
            ("fake-gpu", Device::Other("fake-gpu".into())),
            ("cuda:01", Device::Other("cuda:01".into())),
            ("cuda:x", Device::Other("cuda:x".into())),
            ("vulkan", Device::Vulkan(None)),
            ("vulkan:0", Device::Vulkan(Some(0))),
            ("vulkan:3", Device::Vulkan(Some(3))),
            ("vulkan:01", Device::Other("vulkan:01".into())),
            ("vulkan:+1", Device::Other("vulkan:+1".into())),
            ("vulkan:", Device::Other("vulkan:".into())),
            ("Vulkan", Device::Other("Vulkan".into())),
        ] {
            let parsed: Device = name.parse().unwrap();
            assert_eq!(parsed, device, "{name}");
            assert_eq!(device, name);
            assert_eq!(parsed.to_string(), name);
            assert_eq!(serde_json::to_value(&parsed).unwrap(), serde_json::json!(name));
            assert_eq!(serde_json::from_value::<Device>(serde_json::json!(name)).unwrap(), device);
        }
    }

    #[test]
    fn only_the_cpu_is_the_cpu() {
        assert!(Device::Cpu.is_cpu());
        assert!(!Device::Cuda(Some(0)).is_cpu());
        assert!(!Device::Vulkan(None).is_cpu());
        assert!(!Device::from("fake-gpu").is_cpu());
        assert!(!Device::from("CPU").is_cpu());
    }
}
