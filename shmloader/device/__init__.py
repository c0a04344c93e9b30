"""Device delivery (``ShmLoader(device=...)``): the stage that copies each delivered batch to
the GPU (``stage``), the ``DeviceOps`` seam and its CUDA implementation (``cuda``), and the
page-locked host memory the copies read (``registrar``)."""
