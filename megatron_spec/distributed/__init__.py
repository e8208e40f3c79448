"""What the distributed trainers, generators and placement share: process groups and their backends
(`process_groups`), the weight-update group that carries refits (`weight_group`), and moving a policy's state to host
memory and back (`offload`). Nothing under the single-machine core imports from here.
"""
