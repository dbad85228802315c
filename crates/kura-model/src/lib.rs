//! kura-model
