//! Where a job's ranks are: each rank's stack, read from outside its process, and
//! the stacks of many ranks folded into a screenful.
//!
//! - [`Captured`] is one process's stack as plain data (serde), so that it can travel
//!   between launchers through the coordinator and be shown by any reader;
//! - [`group()`] folds identical stacks into [`Group`]s of ranks, the smallest group
//!   first: in a hang, the odd one out is the rank to look at;
//! - [`render()`] prints them, one line per group, within a fixed number of lines;
//! - [`capture`] (feature `capture`, on by default) reads a live process's stack with
//!   py-spy, without stopping it unless native frames are asked for (feature
//!   `native`). It is the only part that links py-spy: a reader of captured stacks
//!   (a coordinator, the Python package) uses this crate without default features.

#[cfg(feature = "capture")]
pub mod capture;
mod group;
mod stack;

pub use group::{fold, frame_texts, group, rank_list, render, Group, Grouped, Render};
pub use stack::{Captured, Frame, RankStack, ThreadChoice};
