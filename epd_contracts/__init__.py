"""Every message between EPD's processes, typed once (torch-free: the proxy imports it)."""
