"""FX graph passes that insert the runtime's ops into captured ATen graphs."""
