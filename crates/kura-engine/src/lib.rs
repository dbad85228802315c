//! kura-engine
