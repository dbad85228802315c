//! CPU kernels of the forward pass, chosen at run time by CPU features ([`dot::Isa`]).

pub mod arena;
pub mod attention;
pub mod dot;
pub mod matmul;
pub mod ops;
pub mod packed;
pub mod qpacked;
pub mod team;
