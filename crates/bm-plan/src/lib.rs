//! Module size trees and the device-map solver. Pure: it never touches a device.
