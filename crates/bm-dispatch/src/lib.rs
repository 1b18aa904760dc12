//! Forward hooks that move inputs between devices and stream offloaded weights
//! onto the execution device.
