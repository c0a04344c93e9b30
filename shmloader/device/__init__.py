"""Device delivery (``ShmLoader(device=...)``): the stage that copies each delivered batch to
the GPU (``stage``), which GPU that is (``which``), the walk over a batch's containers
(``containers``), the ``DeviceOps`` seam and its CUDA implementation (``cuda``), and the
page-locked host memory the copies read (``registrar``)."""
